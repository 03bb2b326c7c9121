# %% [markdown]
# # batchgen quick start
#
# Run a batch of prompts on a batchgen server from a notebook. Start a server first, for example with the tiny
# built-in demo model: `batchgen-server serve --model demo`. Then install the client in the notebook's environment
# (`pip install ./packages/batchgen-schemas ./packages/batchgen-client` from a checkout; it pulls in neither torch
# nor transformers) and run these cells in order (`# %%` marks a cell in VS Code, PyCharm and Jupytext; the file
# also runs as a plain script).

# %%
import os

from batchgen.client import BatchGenHttpClient

client = BatchGenHttpClient(os.environ.get("BATCHGEN_BASE_URL", "http://localhost:10900"))
print(client.health_check())
model = client.list_models().data[0]
print(f"model {model.id}, context {model.max_context_length} tokens")

# %% [markdown]
# ## Submit a batch
# A list of request bodies is enough: each becomes one input line with `custom_id` `request-<index>`.
# `submit_batch` uploads them, creates the batch, waits (with a progress bar in a notebook or terminal) and,
# given a path, downloads the output file there.

# %%
questions = ["What is a batch?", "Name a colour.", "Count to three.", "Say hello in French."]
requests = [
    {"model": model.id, "messages": [{"role": "user", "content": question}], "max_tokens": 24} for question in questions
]
batch = client.submit_batch(requests, "results.jsonl", temperature=0.0, poll_interval=0.5)
print(batch.status, batch.request_counts, f"{batch.usage.output_tokens} tokens generated")

# %% [markdown]
# ## Read the results
# `iter_results` yields typed lines; `in_input_order=True` puts them in the order of `requests`.

# %%
for question, line in zip(questions, client.iter_results(batch, in_input_order=True), strict=True):
    assert line.response is not None
    body = line.response.body
    answer = body.choices[0].message.content if hasattr(body, "choices") else f"error: {body}"
    print(f"{line.custom_id}: {question!r} -> {answer!r}")

# %% [markdown]
# ## Batches, files and the pool
# Listing methods follow every page for you; `pool_status` shows how busy the server is.

# %%
for recent in list(client.list_batches())[:5]:
    print(recent.id, recent.status, recent.request_counts.total)
print(client.pool_status())

# %% [markdown]
# ## Async
# `AsyncBatchGenHttpClient` has the same methods; in a notebook, `await` them directly instead of `asyncio.run`.

# %%
import asyncio  # noqa: E402

from batchgen.client import AsyncBatchGenHttpClient  # noqa: E402


async def submit_async() -> str:
    async with AsyncBatchGenHttpClient(client.base_url) as async_client:
        done = await async_client.submit_batch(requests[:2], poll_interval=0.5, progress=False)
        return done.status


print(asyncio.run(submit_async()))

# %%
client.close()
