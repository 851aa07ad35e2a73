"""What one rank runs of a Llama-family model, keeping the Hugging Face parameter names:
a pipeline stage, or the whole model; the one that holds the LM head scores its tokens."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshtrain.distributed.context_parallel import ContextAttention, ContextParallel
from meshtrain.distributed.tensor_parallel import as_local
from meshtrain.models.context_attention import use_context_parallel_attention
from meshtrain.models.head_loss import head_loss
from meshtrain.models.packed_attention import packed_causal_mask
from meshtrain.models.routing import Routing


def decoder_inputs(
    hidden: torch.Tensor, position_ids: torch.Tensor | None, context: ContextParallel | None
) -> tuple[torch.Tensor, torch.Tensor | ContextAttention | None]:
    """The rotary positions and the layers' attention mask of a stage's hidden states:
    one causal sequence per row (no mask: sdpa's causal fast path, as HF does for unpadded
    blocks), packed examples, or this rank's share of a context-parallel sequence."""
    if context is not None:
        return context.attention_inputs(position_ids, hidden.shape[1], hidden.device)
    if position_ids is None:
        return torch.arange(hidden.shape[1], device=hidden.device)[None], None
    return position_ids, packed_causal_mask(position_ids)


def run_layers(
    decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, mask: object
) -> torch.Tensor:
    """`decoder`'s layers (a ModuleList, or a stage's ModuleDict) over `hidden`."""
    position_embeddings = decoder.rotary_emb(hidden, positions)
    layers = decoder.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=position_embeddings,
        )
    return hidden


def split_context(module: nn.Module, context: ContextParallel | None) -> None:
    """Give a whole model or stage its place in a cp group (None: off)."""
    module.context = context
    if context is not None:
        use_context_parallel_attention(module)


class WholeModel(nn.Module):
    """A Hugging Face causal LM without pipeline parallelism: its decoder and LM head
    under their own names, with a forward that returns the summed loss of the labels.

    The loss is part of the forward so that everything wrapping the model (FSDP2's
    gathers of the LM head, in particular) sees the head used there, and so that a
    chunked loss never needs the logits (`models.head_loss`).
    """

    def __init__(self, model: nn.Module, context: ContextParallel | None = None) -> None:
        """`context`: this rank's share of every sequence under context parallelism."""
        super().__init__()
        self.config = model.config
        self.model = model.model
        self.lm_head = model.lm_head
        split_context(self, context)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """`position_ids`, `attention_mask`: those of packed examples (none: one sequence
        per row, causal). `per_token`: each label's log-probability instead of the summed
        loss (`models.token_logps`)."""
        if self.context is not None:
            hidden = self.model.embed_tokens(input_ids)
            hidden = run_layers(
                self.model, hidden, *decoder_inputs(hidden, position_ids, self.context)
            )
            return _not_a_view(head_loss(self.model.norm(hidden), self.lm_head, labels, per_token))
        hidden = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
        ).last_hidden_state
        return _not_a_view(head_loss(hidden, self.lm_head, labels, per_token))


def _not_a_view(output: torch.Tensor) -> torch.Tensor:
    """What a module returns, copied if it is a view (`to_local`'s under sequence
    parallelism, per-token log-probabilities reshaped): an in-place op on a view that a
    module wrapped by FSDP2 returns would drop its pre-backward hook, and torch warns on
    every step. The copy is one microbatch's hidden states at most."""
    return output.clone() if output._base is not None else output


class LlamaStage(nn.Module):
    """One pipeline stage of a Llama-family causal LM, with Hugging Face parameter names.

    The first stage holds the embedding, the last the final norm and LM head;
    every stage holds the rotary embedding (no parameters) and computes the
    positions of the whole block itself. Between stages travel plain tensors:
    with sequence parallelism, this rank's sequence shard, rewrapped as a
    DTensor on arrival. The last stage returns the summed loss of the labels
    it is given (`models.head_loss`), or under DPO each label's log-probability.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: range,
        *,
        is_first: bool,
        is_last: bool,
        tp_mesh: DeviceMesh | None = None,
        sequence_parallel: bool = False,
        context: ContextParallel | None = None,
    ) -> None:
        """`tp_mesh`, `sequence_parallel`: how the stage's input arrives from the one
        before (this rank's sequence shard, under sequence parallelism). `context`: this
        rank's share of every sequence under context parallelism."""
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        self.model = nn.Module()
        if is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        self.model.rotary_emb = model.model.rotary_emb
        if is_last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        self.tp_mesh = tp_mesh
        self.sequence_parallel = sequence_parallel and tp_mesh is not None
        split_context(self, context)
        # A mixture of experts' routing (`models.routing`), set by the pipeline runner.
        self.routing: Routing | None = None
        # DPO: the last stage returns each label's log-probability, not the summed loss.
        self.per_token = False

    def forward(
        self,
        inputs: torch.Tensor,
        tally: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`tally`: a mixture of experts' routing tally from the stage before (after the
        first), which this stage adds to and passes on with its output. `position_ids`:
        packed examples' positions (restarting per example), which also keep attention
        inside each example; None: one sequence per row. `labels`: the targets the last
        stage scores (every stage is handed them)."""
        if self.is_first:
            hidden = self.model.embed_tokens(inputs)
        elif self.sequence_parallel:
            hidden = DTensor.from_local(inputs, self.tp_mesh, [Shard(1)], run_check=False)
        else:
            hidden = inputs
        hidden, tally = self._layers(hidden, tally, position_ids)
        if self.is_last:
            output = head_loss(self.model.norm(hidden), self.lm_head, labels, self.per_token)
            output = as_local(output) if self.per_token else output
        else:
            output = hidden.to_local() if isinstance(hidden, DTensor) else hidden
        output = _not_a_view(output)
        return output if tally is None else (output, tally)

    def _layers(
        self, hidden: torch.Tensor, tally: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's layers, and the routing tally with theirs added (None: dense)."""
        inputs = decoder_inputs(hidden, position_ids, self.context)
        if self.routing is None:
            return run_layers(self.model, hidden, *inputs), None
        with self.routing.collecting() as logits:
            hidden = run_layers(self.model, hidden, *inputs)
        sparse = [i for i in map(int, self.model.layers) if i in self.routing.sparse_layers]
        start = self.routing.empty_tally() if tally is None else tally
        return hidden, start + self.routing.tally(logits, sparse)
