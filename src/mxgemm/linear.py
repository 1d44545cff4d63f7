"""``MXFP8Linear``: an ``nn.Module`` holding an MXFP8 weight prepared for its resolved backend."""

from __future__ import annotations

import torch
from torch import nn

from .format import ScaleMode, check_mx_pair, quantize
from .weights import PreparedWeight, linear, prepare_weight

__all__ = ["MXFP8Linear"]


class MXFP8Linear(nn.Module):
    """``y = x @ W^T + b``, ``W`` stored as MXFP8: buffers ``weight`` float8 [N, K], ``weight_scale`` uint8 [N, K/32].

    The backend is resolved when the layer is built and again whenever it moves to another device; a named backend
    that cannot run there raises. Dtype casts of the module (``.half()``, ``.to(torch.bfloat16)``) leave the
    quantized weight as it is and cast only the bias. bf16/fp16 inputs run as they are; fp32/fp64 inputs (models
    kept in fp32) are cast to bf16 for the GEMM and the result back to their dtype.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor

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
        check_mx_pair(weight, weight_scale)
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.requested_backend = backend
        self.requested_recipe = recipe
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.register_buffer("bias", bias)
        self.register_load_state_dict_post_hook(lambda module, _keys: module._prepare())
        self._prepare()

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

    def _prepare(self) -> None:
        self._prepared = prepare_weight(
            self.weight, self.weight_scale, backend=self.requested_backend, recipe=self.requested_recipe
        )

    @torch.no_grad()
    def load_mx_weight(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        """Replace the MX weight in place (same shapes and dtypes) and re-prepare it, as a fresh layer would."""
        check_mx_pair(weight, weight_scale)
        if weight.shape != self.weight.shape or weight.dtype != self.weight.dtype:
            raise ValueError(
                f"new weight must be {self.weight.dtype} {tuple(self.weight.shape)}, "
                f"got {weight.dtype} {tuple(weight.shape)}"
            )
        self.weight.copy_(weight)
        self.weight_scale.copy_(weight_scale)
        self._prepare()

    def _apply(self, fn, recurse=True):
        dtypes = {"weight": self.weight.dtype, "weight_scale": self.weight_scale.dtype}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            t = getattr(self, name)
            if t.dtype != dtype:  # a module-wide dtype cast: fp8 -> fp16/bf16 -> fp8 is exact, so restore it
                setattr(self, name, t.to(dtype))
        self._prepare()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):  # the kernels take bf16/fp16: run in bf16, answer in x.dtype
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            return linear(x.to(torch.bfloat16), self._prepared, bias).to(x.dtype)
        return linear(x, self._prepared, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"backend={self.backend}, recipe={self.recipe}"
        )
