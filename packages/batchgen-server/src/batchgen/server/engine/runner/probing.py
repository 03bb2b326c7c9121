"""The model probed at load, before the caches exist: a few tokens through it with the probe as attention (its
attention layers and their shapes: ``attention/probe.py``), a second forward that finds its state layers
(``features/state/discovery.py``), and the largest step the scheduler may send (its peak sizes the caches:
``profile.py``). Each is a plain forward of one sequence through the model's own code; what it cannot run is refused
at load in one line."""

from __future__ import annotations

from typing import Any

import torch

from ..attention import ATTENTION_NAME, PROBE_NAME, AttentionRefused, LayerProbe, active
from ..attention.reach import compression
from ..config import EngineConfig
from ..errors import ModelLoadError, ModelNotSupported, refused
from ..features.multimodal.vision_step import attention_for
from ..features.state.discovery import StateLayer, StateRefused, discover, state_candidates
from .collectives import smallest_across_ranks

NO_ATTENTION = (
    "its attention does not run through transformers' AttentionInterface, so the engine cannot give it a paged KV cache"
)


PROBE_TOKENS = 8
"""The probe's tokens: ids 0-7, in every vocabulary."""


class ModelProbe:
    """``masks``: what every forward of the model takes besides its tokens (DSA's selections)."""

    def __init__(self, model: Any, device: torch.device, pooling_only: bool, masks: dict[str, Any]) -> None:
        self.model, self.device, self.pooling_only, self.masks = model, device, pooling_only, masks
        self.architecture = type(model).__name__

    def layers(self) -> LayerProbe:
        """Its attention layers: a few tokens through the model with the probe as attention."""
        probe = LayerProbe()
        self.forward(probe)
        return probe

    @torch.no_grad()
    def forward(self, probe: LayerProbe | None = None, tokens: int = PROBE_TOKENS, keep: int = 1) -> None:
        """The model's forward over ``tokens`` tokens of one sequence with ``probe`` as attention, logits for the last
        ``keep`` (and those made float32 and normalized twice, as the sampler does: the largest step's peak)."""
        text = self.model.config.get_text_config()
        positions = torch.arange(tokens, device=self.device).unsqueeze(0)
        ids = positions % PROBE_TOKENS  # the same few tokens, repeated (the memory of a step is not its tokens')
        positions %= getattr(text, "max_position_embeddings", None) or tokens
        self.model.set_attn_implementation(attention_for(self.model, PROBE_NAME))
        try:
            # Eager: layers another engine compiled.
            with active(probe or LayerProbe()), torch.compiler.set_stance("force_eager"):
                if self.pooling_only:
                    self.model.base_model(input_ids=ids, position_ids=positions, use_cache=False, **self.masks)
                else:
                    out = self.model(
                        input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep, **self.masks
                    )
                    torch.softmax(torch.log_softmax(out.logits.float(), dim=-1), dim=-1)
        except torch.OutOfMemoryError:
            why = f"a step of {tokens} tokens ({keep} sampled) does not fit in memory beside the model"
            raise ModelLoadError(f"{why}; lower --max-num-batched-tokens or --max-num-seqs") from None
        except AttentionRefused as exc:
            compressed = compression(text)  # the mechanism, where it declares one
            reason = str(exc) if compressed is None else f"{compressed} is not served: {exc}"
            raise ModelNotSupported(self.architecture, reason) from None
        except Exception as exc:  # a layer that cannot run this way (e.g. one that needs a mask): one line
            raise refused(self.architecture, "its forward failed in the engine's layer probe", exc) from None
        finally:  # never left on the model (other engines may share it)
            self.model.set_attn_implementation(attention_for(self.model, ATTENTION_NAME))

    def largest_step(self, config: EngineConfig) -> None:
        """The largest step the scheduler may send: its token budget in one sequence, as many sampled as run."""
        tokens = config.max_num_batched_tokens
        self.forward(None, tokens, min(config.max_num_seqs, tokens))

    def state_layers(self, probe: LayerProbe, config: EngineConfig) -> tuple[list[StateLayer], bool]:
        """The layers that keep state across a sequence's tokens, found by a second forward, and whether the model
        has any (in stages: whether any stage holds one, for every stage runs that forward); a model with neither
        attention nor state layers is refused."""
        candidates = state_candidates(self.model, probe.modules)
        stateful = bool(candidates)
        if config.pipeline_parallel_size > 1:
            stateful = not smallest_across_ranks([not candidates], self.device)[0]
        try:
            layers = discover(candidates, self.forward)
            if stateful and not candidates:  # the stages' forwards meet: a stage without state layers runs it too
                self.forward()
        except StateRefused as exc:
            raise ModelNotSupported(self.architecture, str(exc)) from None
        except Exception as exc:  # a layer outside attention used the recording cache as no state layer does
            why = f"a layer outside its attention uses its cache as the engine cannot drive ({type(exc).__name__})"
            raise ModelNotSupported(self.architecture, why if probe.modules else NO_ATTENTION) from None
        if not probe.modules and not stateful:
            raise ModelNotSupported(self.architecture, NO_ATTENTION)
        return layers, stateful
