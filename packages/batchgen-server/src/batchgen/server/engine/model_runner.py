"""Owns the model and its paged KV cache; turns a scheduled step into one packed forward."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import ATTENTION_NAME, GatherBuffers, PagedStep, PrefillChunk
from .config import EngineConfig
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: PreTrainedModel, config: EngineConfig) -> None:
        # No autograd, whatever thread steps the engine (grad mode is per thread). With trainable weights, the
        # in-place K/V writes made the cache tensors part of an autograd graph that grew by every step's saved
        # activations and was never freed: RSS grew by gigabytes per few thousand requests.
        model.requires_grad_(False)
        self.model = model
        self.base_model = model.base_model
        self.lm_head = model.get_output_embeddings()
        text_config = model.config.get_text_config()
        self.softcap: float | None = getattr(text_config, "final_logit_softcapping", None)
        self.num_layers: int = text_config.num_hidden_layers
        self.num_kv_heads: int = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim: int = (
            getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        )
        self.block_size = config.block_size
        embeddings = model.get_input_embeddings().weight
        self.device: torch.device = embeddings.device
        self.dtype: torch.dtype = embeddings.dtype
        model.set_attn_implementation(ATTENTION_NAME)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit(config)
        self.buffers = GatherBuffers()
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        for layer in range(self.num_layers):
            shape = (self.num_kv_heads, self.num_blocks * self.block_size, self.head_dim)
            device = self._layer_device(layer)
            # Zeroed: attention reads whole blocks, and a masked-out position must hold a finite value (0 * NaN = NaN).
            self.k_caches.append(torch.zeros(shape, dtype=self.dtype, device=device))
            self.v_caches.append(torch.zeros(shape, dtype=self.dtype, device=device))

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _layer_device(self, layer: int) -> torch.device:
        layers = getattr(self.base_model, "layers", None)
        if layers is not None and len(layers) > layer:
            return next(layers[layer].parameters()).device
        return self.device

    def _blocks_that_fit(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            text_config = self.model.config.get_text_config()
            # Room for the activations of the largest step and the logits of every running sequence.
            activations = config.max_num_batched_tokens * text_config.hidden_size * self.dtype.itemsize * 16
            logits = config.max_num_seqs * text_config.vocab_size * 4 * 4
            budget = free - (1 - config.gpu_memory_utilization) * total - activations - logits
        else:
            budget = config.cpu_kv_cache_gib * 2**30
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 2:
            raise RuntimeError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB); lower the load or dtype")
        return num_blocks

    @torch.no_grad()
    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for cache in (*self.k_caches, *self.v_caches):
            cache[:, dst * bs : (dst + 1) * bs] = cache[:, src * bs : (src + 1) * bs]

    @torch.no_grad()
    def forward(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run every scheduled chunk in one packed forward; return the last hidden states ``[tokens, hidden]``."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        bs = self.block_size
        row = 0
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            elif start == 0:
                prefills.append(PrefillChunk(row, row + n, None, None))
            else:
                num_blocks = -(-(start + n) // bs)
                context = torch.arange(num_blocks * bs)
                mask = context.unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1)
                blocks = torch.tensor(table[:num_blocks])
                prefills.append(PrefillChunk(row, row + n, blocks.to(self.device), mask.to(self.device)))
            row += n
        step = PagedStep(
            block_size=bs,
            buffers=self.buffers,
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            slot_mapping=torch.tensor(slots).to(self.device),
            prefills=prefills,
        )
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables])
            lens = torch.tensor(decode_lens).unsqueeze(1)
            step.decode_blocks = tables.to(self.device)
            step.decode_mask = (torch.arange(width * bs).unsqueeze(0) < lens)[:, None, None, :].to(self.device)
            step.decode_rows = torch.tensor(decode_rows).to(self.device)
        ids = torch.tensor(input_ids).to(self.device)
        pos = torch.tensor(positions).to(self.device)
        out = self.base_model(input_ids=ids.unsqueeze(0), position_ids=pos.unsqueeze(0), use_cache=False, paged=step)
        return out.last_hidden_state[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the given rows only: the positions where a token is sampled."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.device)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
