"""A pipeline stage's forward (``--pipeline-parallel-size``). transformers builds each rank's stage as it loads
(``DistributedConfig(pp_size=M)``: the other stages' layers, and the embeddings, norm and head where this stage has
none, are identity layers, never loaded) and sends the hidden states between stages with its own point-to-point
``PipelineStage.communicate``; this forward replaces its generate-oriented wrapper (which passes the forward's
``**kwargs`` on as one argument named ``kwargs``) with the engine's call: the stage's own forward between a receive
from the stage before and a send to the stage after, the last stage's logits (and hidden states, when a step asks)
broadcast to every stage, so that the driver, on the first, samples. Between the stages only the residual stream
passes: transformers' decoder layers add their residuals inside, so one ``[1, tokens, hidden]`` tensor is all."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class StageForward:
    """Installed as the model's ``forward`` on every rank of a pipeline-parallel group (each stage of it)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.stage: Any = model._pp_stage  # transformers' PipelineStage, on the mesh's pp dimension
        model.__dict__.pop("forward", None)  # transformers' wrapper off: the class's forward again
        self.own_forward = model.forward
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        model.forward = self

    @property
    def last(self) -> bool:
        return bool(self.stage.pp_is_last_stage)

    def __call__(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        device, dtype = self._where()
        if self.stage.pp_is_first_stage:
            kwargs["input_ids"] = input_ids
        else:  # the stage before's residual stream, as this stage's input embeddings
            assert input_ids is not None
            shape = (*input_ids.shape[:2], self.hidden_size)
            kwargs["inputs_embeds"] = self.stage.communicate("recv_forward", device=device, dtype=dtype, shape=shape)
        logits = None
        if self.last:
            logits = self.own_forward(**kwargs).logits
        else:
            kwargs.pop("logits_to_keep", None)
            hidden = self.model.base_model(**kwargs).last_hidden_state
            self.stage.communicate("send_forward", device=device, dtype=dtype, tensor=hidden)
        return CausalLMOutputWithPast(logits=self.from_last(logits))

    def from_last(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``[1, rows, width]`` tensor on every stage (every stage calls it at once)."""
        device, dtype = self._where()
        result: torch.Tensor = self.stage.broadcast_from_last(tensor if self.last else None, dtype=dtype, device=device)
        return result

    def _where(self) -> tuple[torch.device, torch.dtype]:
        weight = next(self.model.parameters())
        return weight.device, weight.dtype


def stages_of(model: PreTrainedModel) -> StageForward | None:
    """The stage forward of a model loaded as a pipeline stage (installed once), or ``None``."""
    if getattr(model, "_pp_stage", None) is None:
        return None
    forward = model.__dict__.get("forward")
    return forward if isinstance(forward, StageForward) else StageForward(model)
