"""The routed experts of a mixture-of-experts layer: ``moe_experts`` (functional) and ``MXFP8Experts`` (the module
that takes the place of transformers' 3-D experts modules).

A call is one op, ``mxgemm::moe_experts``, on the experts' backend: the token copies sorted by expert, the gate/up
projection, ``silu(gate) * up``, the down projection, and each token's copies weighted by the router and summed in a
fixed order (:meth:`mxgemm.backends.capabilities.GroupedWeights.run_experts`; the Triton backend does it in four
launches, six where SM90's wgmma kernel runs). Deterministic, no host synchronisation and no shape that depends on
the routing, so that a decode step captures in a CUDA graph and compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import torch
from torch import nn

from . import tuning
from .backends import get_backend
from .device import DeviceInfo
from .format import check_mx_pair, quantize
from .graphs import EagerGraphs, graphable
from .grouped import PreparedGroupedWeight, check_grouped, prepare_grouped_weight
from .linear import MXModule
from .ops import moe_experts_op
from .resolve import explain_auto

__all__ = [
    "GRAPHED_TOKENS",
    "PROJECTIONS",
    "MXFP8Experts",
    "experts_layout_reason",
    "experts_modules",
    "experts_stay_in_bf16",
    "experts_unfit_reason",
    "is_experts_module",
    "moe_experts",
    "per_expert_names",
    "per_expert_shapes",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # each expert's, as checkpoints store experts
# Eager calls of up to this many tokens (decode batches) replay CUDA graphs; a graph keeps a static copy of the
# tokens and its output ([T, H] each), so longer calls (prompts of any length) run directly.
GRAPHED_TOKENS = 64


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: PreparedGroupedWeight,
    down: PreparedGroupedWeight,
) -> torch.Tensor:
    """``x`` [T, H] (bf16/fp16; fp32 runs in bf16 and answers fp32), each token sent to ``topk_ids`` [T, k] (integer
    expert ids) with ``topk_weights`` [T, k]: ``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for
    ``e = topk_ids[t, j]``, [T, H]. ``gate_up``: the experts' [E, 2I, H] (gate rows first, then up, as transformers
    stacks them); ``down``: [E, H, I], both prepared on one backend. The products round to the activations' dtype
    as transformers' experts round them, and each token's weighted copies are summed in fp32 in top-k order, rounded
    once. A copy routed outside ``[0, E)`` (expert parallelism's experts of other ranks) adds nothing; the ids are
    not checked on the host, which would wait for the GPU. No copies (no tokens, or ``k`` = 0) answer zeros."""
    check_grouped(gate_up, "gate_up")
    check_grouped(down, "down")
    reason = _pair_reason(gate_up, down)
    if reason:
        raise ValueError(reason)
    _check_call(x, topk_ids, topk_weights, gate_up.in_features, gate_up.device)
    return _experts_op(
        x, topk_ids, topk_weights, gate_up.op_tensors, down.op_tensors, gate_up.backend, gate_up.op_meta, down.op_meta
    )


def _pair_reason(gate_up: PreparedGroupedWeight, down: PreparedGroupedWeight) -> str:
    """Why ``gate_up`` and ``down`` are not one layer's experts on one backend ("" when they are)."""
    if gate_up.experts != down.experts or gate_up.out_features != 2 * down.in_features:
        return (
            f"gate_up [{gate_up.experts}, {gate_up.out_features}, {gate_up.in_features}] and down [{down.experts}, "
            f"{down.out_features}, {down.in_features}] are not one layer's experts ([E, 2I, H] and [E, H, I])"
        )
    if gate_up.backend != down.backend:
        return f"gate_up runs on {gate_up.backend} and down on {down.backend}; prepare both on one backend"
    return ""


def _check_call(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, hidden: int, device: torch.device
) -> None:
    """A call's inputs against experts of hidden size ``hidden`` on ``device``."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got shape {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k] for x of {x.shape[0]} tokens, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")
    if not (x.device == topk_ids.device == topk_weights.device == device):
        raise ValueError(
            f"x, topk_ids and topk_weights must be on {device}, where the experts are; got {x.device}, "
            f"{topk_ids.device}, {topk_weights.device}"
        )


def _experts_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_tensors: list[torch.Tensor],
    down_tensors: list[torch.Tensor],
    backend: str,
    gate_up_meta: str,
    down_meta: str,
) -> torch.Tensor:
    """One ``mxgemm::moe_experts`` op on checked inputs: fp32 activations run in bf16 and the answer comes back in
    ``x``'s dtype."""
    dtype = x.dtype
    x = x if dtype in (torch.bfloat16, torch.float16) else x.to(torch.bfloat16)  # fp32 models: bf16 activations
    y = moe_experts_op(
        x.contiguous(),
        topk_ids.contiguous(),
        topk_weights.to(x.dtype).contiguous(),
        gate_up_tensors,
        down_tensors,
        backend,
        gate_up_meta,
        down_meta,
    )
    return y.to(dtype)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model``, by name: those holding ``gate_up_proj`` and ``down_proj`` (transformers'
    experts; :func:`experts_unfit_reason` says which :class:`MXFP8Experts` takes), :class:`MXFP8Experts` excluded."""
    return [(name, module) for name, module in model.named_modules() if is_experts_module(module)]


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds experts as transformers' 3-D experts modules do (``gate_up_proj`` and ``down_proj``
    tensors; a gated MLP's linear layers of those names, as Phi-3's, are not), not yet an :class:`MXFP8Experts`."""
    held = (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))
    return all(isinstance(t, torch.Tensor) for t in held) and not isinstance(module, MXFP8Experts)


def per_expert_names(name: str, experts: int) -> dict[str, list[str]]:
    """The tensors checkpoints store an experts module ``name`` of ``experts`` experts as, by projection:
    ``<name>.<e>.{gate,up,down}_proj.weight`` (each with ``weight_scale`` beside it where quantized)."""
    prefix = f"{name}." if name else ""
    return {p: [f"{prefix}{e}.{p}.weight" for e in range(experts)] for p in PROJECTIONS}


def per_expert_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Each expert's projection shapes ``[N, K]`` for a 3-D experts module (``down_proj`` [E, H, I])."""
    _, hidden, width = module.down_proj.shape
    return {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}


def experts_stay_in_bf16(device: torch.device | DeviceInfo, backend: str | None, recipe: str | None) -> str:
    """Why experts on ``device`` are kept in bf16 under ``backend`` (None: ``auto``), or "": ``auto`` on a GPU where
    no backend but the emulation runs grouped weights, whose experts would run many times slower than bf16's."""
    if (backend or "auto") != "auto" or device.type != "cuda":
        return ""
    if explain_auto(device, recipe=recipe, grouped=True).backend.name != "emulation":
        return ""
    return "no backend runs grouped weights fast on this GPU yet (name backend='emulation' to emulate)"


# transformers' declared layout of an experts class (``use_experts_implementation``'s flags) as MXFP8Experts holds it
_LAYOUT = {
    "is_transposed": (False, "its weights are stored transposed ([E, H, 2I] and [E, I, H])"),
    "is_concatenated": (True, "its gate and up rows are interleaved"),
    "has_bias": (False, "its projections have biases"),
    "has_gate": (True, "it has no gate projection"),
}


def experts_unfit_reason(module: nn.Module) -> str:
    """Why ``module`` is not an experts module :class:`MXFP8Experts` takes the place of, or "" where it is: its
    weights laid out as MXFP8Experts holds them (:func:`experts_layout_reason`), ``silu(gate) * up`` between them
    (:func:`_gate_reason`), nothing after each expert, no other tensors or modules."""
    reason = experts_layout_reason(module)
    if reason:
        return reason
    if getattr(module, "has_post_expert_norm", False):
        return "it normalizes each expert's output"
    others = [n for n, _ in module.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    others += [n for n, _ in module.named_buffers()] + [n for n in module._modules if n != "act_fn"]
    if others:
        return f"it holds {', '.join(others)} besides its projections"
    return _gate_reason(module, module.gate_up_proj.shape[1])


def experts_layout_reason(module: nn.Module) -> str:
    """Why the weights of ``module`` are not laid out as :class:`MXFP8Experts` holds them (and checkpoints store them
    per expert), or "": 3-D ``gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I] parameters
    without biases, K (H and I) a multiple of 32, whatever they compute."""
    for flag, (fit, reason) in _LAYOUT.items():
        if getattr(module, flag, fit) != fit:
            return reason
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return "no 3-D gate_up_proj and down_proj tensors"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not 3-D"
    e, two_i, h = gate_up.shape
    if down.shape == (e, h // 2, two_i) and h % 2 == 0:  # Llama 4's, whose class declares no layout
        return _LAYOUT["is_transposed"][1]
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return f"down_proj {tuple(down.shape)} does not match gate_up_proj {tuple(gate_up.shape)} as [E, H, I]"
    if any(getattr(module, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
        return "its projections have biases"
    if h % 32 or (two_i // 2) % 32:
        return f"hidden size {h} or expert width {two_i // 2} is not a multiple of 32"
    return ""


def _gate_reason(module: nn.Module, two_i: int) -> str:
    """Why the gate of ``module`` is not ``silu(gate) * up`` of its gate/up output's halves, or "". transformers'
    experts apply their class's ``_apply_gate`` there, by default ``act_fn(gate) * up``; a class's own (a clamp, a
    scaled SwiGLU) is taken where it answers as silu(gate) * up on values of both signs from 1e-8 to 1e38, where any
    clamp of finite values shows."""
    own = getattr(type(module), "_apply_gate", None)
    if own is None or getattr(own, "__qualname__", "") == "_default_apply_gate":
        act = type(getattr(module, "act_fn", None)).__name__
        return "" if act in ("SiLU", "SiLUActivation") else f"its activation is {act}, not SiLU"
    g = torch.Generator().manual_seed(0)
    shape, cpu = (64, two_i), torch.device("cpu")  # on the CPU under any default device (transformers' meta)
    signs = torch.randint(0, 2, shape, generator=g, device=cpu) * 2 - 1
    probe = signs * torch.pow(10.0, torch.rand(shape, generator=g, device=cpu) * 46 - 8)
    gate, up = probe.chunk(2, dim=-1)
    try:
        with torch.no_grad():
            got = module._apply_gate(probe.clone())
    except Exception as error:  # any failure of the class's own code leaves the experts as they are
        return f"its own _apply_gate failed on a float32 probe ({type(error).__name__})"
    want = torch.nn.functional.silu(gate) * up
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype):
        return "its own _apply_gate does not answer [S, I] in its input's dtype"
    if not torch.allclose(got, want, rtol=1e-5, atol=0.0, equal_nan=True):
        return "its own _apply_gate is not silu(gate) * up (a clamp or another activation)"
    return ""


def _prepared_pair(
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    backend: str | None,
    recipe: str | None,
) -> tuple[PreparedGroupedWeight, PreparedGroupedWeight]:
    """An experts module's two grouped weights prepared from their MX tensors, on their device, for one request."""
    options = {"backend": backend, "recipe": recipe}
    gate_up_weight = prepare_grouped_weight(gate_up, gate_up_scale, **options)
    return gate_up_weight, prepare_grouped_weight(down, down_scale, **options)


class MXFP8Experts(MXModule):
    """The experts of one mixture-of-experts layer on prepared grouped weights, called as transformers calls its 3-D
    experts modules: ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
    (:func:`moe_experts`). ``gate_up_proj`` / ``down_proj`` and their ``_scale`` are the MX tensors rebuilt from the
    prepared weights (what they compute), as in its state dict. ``backend`` / ``recipe``: what the weights were
    prepared for (None: ``auto``), asked again where they are prepared anew: a state dict loaded (its four MX tensors
    together, checked for dtype and shape) or a move to another device; dtype casts of the module leave them as they
    are."""

    # its MX tensors, as its state dict and transformers' stacked checkpoints name them (in _prepared_pair's order)
    mx_keys = ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale")

    def __init__(
        self,
        gate_up: PreparedGroupedWeight,
        down: PreparedGroupedWeight,
        *,
        backend: str | None = None,
        recipe: str | None = None,
    ):
        super().__init__()
        self.requested_backend, self.requested_recipe = backend, recipe
        self._hold(gate_up, down)

    def _hold(self, gate_up: PreparedGroupedWeight, down: PreparedGroupedWeight) -> None:
        reason = _pair_reason(gate_up, down)
        if reason:
            raise ValueError(reason)
        self._gate_up, self._down = gate_up, down  # read-only: what the traced call reads (_op) stays theirs
        self.num_experts = gate_up.experts
        # what a traced call reads (_traced): the op's arguments as plain values in the module's own __dict__
        self._op = {"gate_up": gate_up.traced_args(), "down": down.traced_args(), "hidden": gate_up.in_features}
        self._graphs = EagerGraphs()  # graphs read the weights they were captured with: new weights, new graphs
        self._held()

    def mx_tensors(self) -> dict[str, torch.Tensor]:
        (gate_up, gate_up_scale), (down, down_scale) = self._exported(self.gate_up), self._exported(self.down)
        return dict(zip(self.mx_keys, (gate_up, gate_up_scale, down, down_scale), strict=True))

    def _check_mx_tensors(self, new: dict[str, torch.Tensor], prefix: str) -> None:
        for weight, want in (("gate_up_proj", self.gate_up), ("down_proj", self.down)):
            shape = [want.experts, want.out_features, want.in_features]
            try:
                check_mx_pair(new[weight], new[weight + "_scale"])
                if list(new[weight].shape) != shape:
                    raise ValueError(f"must be {shape}, got {list(new[weight].shape)}")
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{prefix}{weight} and its scale: {exc}") from None

    def _prepare_mx(self, new: dict[str, torch.Tensor]) -> None:
        self._hold(*_prepared_pair(*(new[key] for key in self.mx_keys), self.requested_backend, self.requested_recipe))

    @property
    def mx_device(self) -> torch.device:
        return self.gate_up.device

    @classmethod
    def from_experts(
        cls,
        module: nn.Module,
        *,
        backend: str | None = None,
        scale_mode: str = "floor",
        recipe: str | None = None,
    ) -> MXFP8Experts:
        """Quantize an experts module's ``gate_up_proj`` and ``down_proj`` (:func:`experts_unfit_reason` says which
        it takes) and prepare them on their device."""
        reason = experts_unfit_reason(module)
        if reason:
            raise TypeError(f"{type(module).__name__} cannot become MXFP8Experts: {reason}")

        def prepared(weight: torch.Tensor) -> PreparedGroupedWeight:
            t = quantize(weight.detach(), scale_mode=scale_mode)
            return prepare_grouped_weight(t.qdata, t.scale, backend=backend, recipe=recipe)

        return cls(prepared(module.gate_up_proj), prepared(module.down_proj), backend=backend, recipe=recipe)

    @classmethod
    def from_quantized(
        cls,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
        *,
        backend: str | None = None,
        recipe: str | None = None,
    ) -> MXFP8Experts:
        """The experts from their MX tensors as checkpoints hold them once stacked: ``gate_up`` float8 [E, 2I, H]
        (gate rows first, then up) and ``down`` [E, H, I], each with its E8M0 scale (uint8 or float8_e8m0fnu,
        [E, N, K/32]), prepared on their device (:func:`mxgemm.prepare_grouped_weight`)."""
        pair = _prepared_pair(gate_up, gate_up_scale, down, down_scale, backend, recipe)
        return cls(*pair, backend=backend, recipe=recipe)

    @property
    def gate_up(self) -> PreparedGroupedWeight:
        return self._gate_up

    @property
    def down(self) -> PreparedGroupedWeight:
        return self._down

    @property
    def backend(self) -> str:
        return self.gate_up.backend

    @property
    def recipe(self) -> str:
        return self.gate_up.recipe

    def _exported(self, weight: PreparedGroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        return get_backend(weight.backend).export_grouped_mx(weight)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self._exported(self.gate_up)[0]

    @property
    def gate_up_proj_scale(self) -> torch.Tensor:
        return self._exported(self.gate_up)[1]

    @property
    def down_proj(self) -> torch.Tensor:
        return self._exported(self.down)[0]

    @property
    def down_proj_scale(self) -> torch.Tensor:
        return self._exported(self.down)[1]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """:func:`moe_experts`; unless ``MXGEMM_EAGER_GRAPHS=0``, eager calls of up to :data:`GRAPHED_TOKENS` tokens
        replay a CUDA graph of the call for their shapes (:class:`mxgemm.graphs.EagerGraphs`: the same launches, a
        fraction of their host time)."""
        args = (hidden_states, top_k_index, top_k_weights)
        if torch.compiler.is_compiling():
            return self._traced(*args)
        if graphable(*args, max_rows=GRAPHED_TOKENS):
            return self._graphs(self._run, *args, key=tuning.generation())
        return self._run(*args)

    def _run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return moe_experts(hidden_states, top_k_index, top_k_weights, self._gate_up, self._down)

    def _traced(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``forward`` as ``torch.compile`` traces it: the same checks and op, reading only the plain values the module
        holds in its own ``__dict__`` (``_op``), so that Dynamo skips its guards while that ``__dict__`` is unchanged
        (``MXFP8Linear._traced`` says why)."""
        gate_up, down = self._op["gate_up"], self._op["down"]
        gate_up_tensors, down_tensors = list(gate_up["tensors"].values()), list(down["tensors"].values())
        _check_call(hidden_states, top_k_index, top_k_weights, self._op["hidden"], gate_up_tensors[0].device)
        return _experts_op(
            hidden_states,
            top_k_index,
            top_k_weights,
            gate_up_tensors,
            down_tensors,
            gate_up["backend"],
            gate_up["meta"],
            down["meta"],
        )

    def extra_repr(self) -> str:
        e, two_i, h = self.num_experts, self.gate_up.out_features, self.gate_up.in_features
        return f"experts={e}, hidden={h}, width={two_i // 2}, backend={self.backend}, recipe={self.recipe}"
