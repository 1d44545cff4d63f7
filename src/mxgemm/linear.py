"""``MXFP8Linear``: an ``nn.Module`` holding an MXFP8 weight prepared for its resolved backend, and nothing else."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .backends import get_backend
from .backends.capabilities import GatedInput
from .format import SCALE_DTYPES, ScaleMode, check_mx_pair, quantize
from .ops import run_gated
from .weights import PreparedWeight, check_inputs, linear, op_linear, op_linear_gated, prepare_weight, wants_grad

__all__ = ["MXFP8Linear", "MXModule"]

# The group outputs (mxgemm.fusion) a trace has made and not yet handed to all their members, by group key:
# [input, output, members still to take theirs]. Traced calls only; the entry goes when the last member takes its view.
# A module global: the compiled model guards on it once, where state on each layer would cost guards on every layer.
_TRACED_GROUPS: dict[int, list] = {}

_WIDE = (torch.float32, torch.float64)  # inputs run in bf16, their outputs cast back
_PREPARATIONS = itertools.count()  # MXModule._held's numbers
_ABSENT = object()


class MXModule(nn.Module):
    """What :class:`MXFP8Linear` and :class:`mxgemm.moe.MXFP8Experts` share: their state dict holds their MX tensors
    (``mx_keys``), rebuilt from the prepared weights; loading one takes them all together, checked, and prepares them
    anew on the module's device (never a new tensor beside old ones); a move to another device prepares them there;
    dtype casts leave them as they are."""

    mx_keys: tuple[str, ...] = ()

    def _held(self) -> None:
        """Number the prepared weights the module now holds, once more: a plain value in its ``__dict__`` for what
        keys on a module's state by value (the graphs of :mod:`mxgemm.moe_blocks`), where the ids of weights freed
        may come back on new ones; the number never does."""
        self._holding = next(_PREPARATIONS)

    def mx_tensors(self) -> dict[str, torch.Tensor]:
        """The MX tensors of what the module computes, by ``mx_keys``."""
        raise NotImplementedError

    def _check_mx_tensors(self, new: dict[str, torch.Tensor], prefix: str) -> None:
        """Raise TypeError/ValueError, naming the tensor, unless ``new`` can replace the module's MX tensors."""
        raise NotImplementedError

    def _prepare_mx(self, new: dict[str, torch.Tensor]) -> None:
        """Prepare anew from MX tensors (checked), on their device."""
        raise NotImplementedError

    @property
    def mx_device(self) -> torch.device:
        """Where the prepared weights are."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.update({prefix + name: t for name, t in self.mx_tensors().items()})

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        keys = [prefix + name for name in self.mx_keys]
        unexpected_keys[:] = [key for key in unexpected_keys if key not in keys]
        present = [key in state_dict for key in keys]
        if not all(present):
            missing_keys.extend(key for key, there in zip(keys, present, strict=True) if not there)
            if any(present):
                error_msgs.append(f"{', '.join(keys[:-1])} and {keys[-1]} must be loaded together")
            return
        new = {name: state_dict[key] for name, key in zip(self.mx_keys, keys, strict=True)}
        try:
            self._check_mx_tensors(new, prefix)
        except (TypeError, ValueError) as exc:
            error_msgs.append(str(exc))
            return
        self._prepare_mx({name: t.to(self.mx_device) for name, t in new.items()})

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self.mx_device
        target = fn(torch.empty(0, dtype=torch.uint8, device=device)).device  # dtype casts leave uint8 alone
        if target != device:
            self._prepare_mx({name: t.to(target) for name, t in self.mx_tensors().items()})
        return self


class MXFP8Linear(MXModule):
    """``y = x @ W^T + b`` with ``W`` an MXFP8 weight ``weight`` float8 [N, K] with ``weight_scale`` uint8 [N, K/32].

    The layer keeps one copy of the weight on its device: the backend's prepared tensors. ``weight`` and
    ``weight_scale`` (attributes and ``state_dict`` entries) are the MX checkpoint tensors rebuilt from them, which
    dequantize exactly to what the layer computes; loading a state dict re-prepares from the MX tensors it holds,
    checked for dtype and shape. The backend is resolved when the layer is built and again whenever it moves to
    another device; a named backend that cannot run there raises. Dtype casts of the module (``.half()``,
    ``.to(torch.bfloat16)``) leave the quantized weight as it is and cast only the bias. bf16/fp16 inputs run as they
    are; fp32/fp64 inputs (models kept in fp32) are cast to bf16 for the GEMM and the result back to their dtype.
    Layers that read the same input may run as one (:mod:`mxgemm.fusion`): ``shared`` is then (group, index), and the
    layer's repr shows ``shared_input=index`` while the group runs as one.
    """

    shared: tuple | None = None
    mx_keys = ("weight", "weight_scale")

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        backend: str | None = None,
        recipe: str | None = None,
    ):
        super().__init__()
        # in a group of mxgemm.fusion: (group, index), and what a traced call reads of the group (see _traced)
        self.shared, self._traced_group = None, None
        check_mx_pair(weight, weight_scale)
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.requested_backend = backend
        self.requested_recipe = recipe
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.register_buffer("bias", bias)
        self._prepare(weight, weight_scale)

    @classmethod
    def from_linear(
        cls,
        linear_layer: nn.Linear,
        *,
        backend: str | None = None,
        scale_mode: ScaleMode = "floor",
        recipe: str | None = None,
    ) -> MXFP8Linear:
        """Quantize an ``nn.Linear``'s weight to MXFP8 (online) and build the layer on the same device."""
        t = quantize(linear_layer.weight.detach(), scale_mode=scale_mode)
        bias = None if linear_layer.bias is None else linear_layer.bias.detach().clone()
        return cls(t.qdata, t.scale, bias, backend=backend, recipe=recipe)

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        backend: str | None = None,
        recipe: str | None = None,
    ) -> MXFP8Linear:
        """Build from checkpoint tensors: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` uint8 [N, K/32]."""
        return cls(weight, weight_scale, bias, backend=backend, recipe=recipe)

    @property
    def prepared(self) -> PreparedWeight:
        return self._prepared

    @property
    def backend(self) -> str:
        return self._prepared.backend

    @property
    def recipe(self) -> str:
        return self._prepared.recipe

    def mx_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``weight``, ``weight_scale``): the MX checkpoint tensors of what the layer computes, rebuilt from the
        prepared weight (views of it where its layout allows)."""
        return get_backend(self._prepared.backend).export_mx(self._prepared)

    @property
    def weight(self) -> torch.Tensor:
        return self.mx_weight()[0]

    @property
    def weight_scale(self) -> torch.Tensor:
        return self.mx_weight()[1]

    def _prepare(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        self._leave_group("re-prepared")
        self._hold(prepare_weight(weight, weight_scale, backend=self.requested_backend, recipe=self.requested_recipe))

    def _hold(self, prepared: PreparedWeight) -> None:
        self._prepared = prepared
        self._op = prepared.traced_args()  # what a traced call reads (_traced)
        backend = get_backend(prepared.backend)  # on_gated's fewest rows, or None
        self._gated_from = backend.gated_from(prepared) if isinstance(backend, GatedInput) else None
        self._held()

    @torch.no_grad()
    def load_mx_weight(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        """Replace the MX weight (same shapes and dtypes) and re-prepare it, as a fresh layer would. The tensors
        passed in are read, never written."""
        self._check_mx(weight, weight_scale, "new weight", "new weight_scale")
        self._prepare(weight.to(self._prepared.device), weight_scale.to(self._prepared.device))

    def _check_mx(self, weight: torch.Tensor, scale: torch.Tensor, wname: str, sname: str) -> None:
        n, k = self.out_features, self.in_features
        current = self._prepared.tensors["qdata"].dtype
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or weight.shape != (n, k):
            raise ValueError(
                f"{wname} must be float8 [{n}, {k}] (e.g. {current}), got {weight.dtype} {tuple(weight.shape)}"
            )
        if scale.dtype not in SCALE_DTYPES or scale.shape != (n, k // 32):
            raise ValueError(
                f"{sname} must be uint8 (or float8_e8m0fnu) [{n}, {k // 32}], got {scale.dtype} {tuple(scale.shape)}"
            )

    def mx_tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.mx_keys, self.mx_weight(), strict=True))

    def _check_mx_tensors(self, new: dict[str, torch.Tensor], prefix: str) -> None:
        self._check_mx(new["weight"], new["weight_scale"], prefix + "weight", prefix + "weight_scale")

    def _prepare_mx(self, new: dict[str, torch.Tensor]) -> None:
        self._prepare(new["weight"], new["weight_scale"])

    @property
    def mx_device(self) -> torch.device:
        return self._prepared.device

    def share(self, prepared: PreparedWeight, bias: torch.Tensor | None, shared: tuple, traced: dict) -> None:
        """Join a group of layers that read the same input (:func:`mxgemm.fusion.fuse_shared_inputs`): ``prepared``
        and ``bias`` are this layer's row views of the group's weight and bias; ``traced`` what a traced call reads
        of the group (see ``_traced_group_output``)."""
        self._hold(prepared)
        self.shared, self._traced_group = shared, traced
        if bias is not None:
            self.bias = bias

    def _leave_group(self, why: str) -> None:
        if self.shared is not None:
            self.shared[0].disable(f"a member was {why}")
            self.shared = self._traced_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced(x)
        # the buffer read from its dict: nn.Module.__getattr__ costs 0.9 µs a call on a CPU host (a bias replaced
        # by a Parameter lives in _parameters: read as an attribute then)
        bias = self._buffers.get("bias", _ABSENT)
        if bias is _ABSENT:
            bias = self.bias
        if x.dtype in _WIDE:  # the kernels take bf16/fp16: run in bf16, answer in x.dtype
            wide = None if bias is None else bias.to(torch.bfloat16)
            return linear(x.to(torch.bfloat16), self._prepared, wide).to(x.dtype)
        shared = self.shared
        if shared is not None and shared[0].enabled:
            y = shared[0].output(shared[1], x, bias)
            if y is not None:
                return y
        return linear(x, self._prepared, bias)

    def on_gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """``self(silu(gate) * up)``, the product quantized by one kernel that reads ``gate`` and ``up``
        (:func:`mxgemm.ops.run_gated`, :mod:`mxgemm.gated`): the same bits. None where that does not run (traced,
        subclass or fp32 inputs, gradients, an M or backend whose call does not quantize its input): the
        caller then computes the product and calls the layer. Hooks on the layer are the caller's to honour."""
        start = self._gated_from  # fewer rows, or a backend that never runs it: at once
        if start is None or gate.numel() < start * gate.shape[-1] or torch.compiler.is_compiling():
            return None
        bias = self._buffers.get("bias", _ABSENT)
        if bias is _ABSENT:
            bias = self.bias
        fast = self._prepared.fast  # M's route, where C++ calls it (mxgemm.fastcall)
        if fast is not None:
            y = fast.gated(gate, up, bias)
            if y is not None:
                return y
        if type(gate) is not torch.Tensor or type(up) is not torch.Tensor:
            return None
        if not gate.numel() or not _gated_operands(gate, up, bias):
            return None
        w = self._prepared
        check_inputs(gate, w.in_features, w.out_features, w.device, bias)
        g, u = gate.reshape(-1, w.in_features), up.reshape(-1, w.in_features)
        y = run_gated(g, u, w, bias)
        return None if y is None else y.reshape(*gate.shape[:-1], y.shape[-1])

    def traced_gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """:meth:`on_gated` as ``torch.compile`` traces it: one ``mxgemm::linear_gated`` op, whose implementation runs
        the product as an eager call does, or computes it first where that does not run (the same bits, those of the
        model's steps run eagerly). None where the caller runs its own steps: fewer rows than :meth:`on_gated` takes
        (a compiled decode step then keeps the model's SiLU and product, which the compiler fuses into one kernel), fp32
        inputs, gradients. Reads what ``_traced`` reads, and the layer's ``_gated_from``."""
        bias, start = self.bias, self._gated_from
        if start is None or gate.numel() < start * gate.shape[-1]:
            return None
        if not _gated_operands(gate, up, bias):
            return None
        check_inputs(gate, self.in_features, self.out_features, _device(self._op), bias)
        return op_linear_gated(gate, up, self._op, self.out_features, bias)

    def _traced(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` as ``torch.compile`` traces it, with the same steps. Without gradients it reads only values the
        layer holds in its own ``__dict__`` (tensors, strings, ints, None and dicts of them; a group member the
        group's dict): Dynamo's guards on such a module are skipped whole while its ``__dict__`` is unchanged, as on
        an ``nn.Linear``; reading through an object of ours (the prepared weight, the group) makes it check each
        guard on every call. Only switching a group off reads the group itself."""
        bias, dtype = self.bias, x.dtype
        cast = dtype in _WIDE
        if cast:
            x, bias = x.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16)
        if wants_grad(x, bias):  # each member of a group alone: the same recipe on the same weight bits
            y = linear(x, self._prepared, bias)
        else:
            group, y = self._traced_group, None
            if not cast and group is not None and group["on"]:
                y = self._traced_group_output(group, x, bias)
            if y is None:
                check_inputs(x, self.in_features, self.out_features, _device(self._op), bias)
                y = op_linear(x, self._op, self.out_features, bias)
        return y.to(dtype) if cast else y

    def _traced_group_output(self, group: dict, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """This group member's traced output: its columns of the group's one op on ``x``, or None where it runs
        alone. The steps of :meth:`mxgemm.fusion.SharedInput.output`: the first member called on an input makes the
        group's output and the others take their views; a replaced bias, or a member called on another input while
        others have not taken theirs, ends the group."""
        entry = _TRACED_GROUPS.get(group["key"])
        why = "a member's bias was replaced" if bias is not group["bias_view"] else ""
        if entry is not None and entry[0] is not x:
            why = "its members were called on different inputs"
        if why:
            _TRACED_GROUPS.pop(group["key"], None)
            self.shared[0].disable(why)
            return None
        if x.numel() > group["max_rows"] * x.shape[-1]:
            return None
        if entry is None:
            check_inputs(x, self.in_features, group["rows"], _device(group), group["bias"])
            y = op_linear(x, group, group["rows"], group["bias"])
            entry = _TRACED_GROUPS[group["key"]] = [x, y, group["members"]]
        entry[2] -= 1
        if entry[2] == 0:
            del _TRACED_GROUPS[group["key"]]
        return entry[1].narrow(-1, group["start"], self.out_features)

    def extra_repr(self) -> str:
        shared = "" if self.shared is None or not self.shared[0].enabled else f", shared_input={self.shared[1]}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"backend={self.backend}, recipe={self.recipe}{shared}"
        )


def _gated_operands(gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a gated call takes these operands: gate and up of one shape and a kernel dtype (not fp32), no
    gradients asked for."""
    return (
        gate.dtype not in _WIDE
        and up.dtype == gate.dtype
        and up.shape == gate.shape
        and not wants_grad(gate, bias)
        and not wants_grad(up, None)
    )


def _device(op: dict) -> torch.device:
    """The device of the weight whose op arguments ``op`` holds."""
    return next(iter(op["tensors"].values())).device
