"""Benchmark networks by name beyond the built-in ones: any torchvision model, any transformers model
type (random init, from its default config: no download) or a ``.pt2`` file."""

from __future__ import annotations

from pathlib import Path

from ..compat import import_torchvision, import_transformers
from ..errors import CwmError

SEQ_LEN = 128
IMAGE_SIZES = {"inception_v3": 299}  # torchvision models whose default input is not 224x224


def torchvision_names() -> list[str]:
    return list(import_torchvision().models.list_models())


def transformers_types() -> list[str]:
    return sorted(import_transformers().CONFIG_MAPPING.keys())


def _torchvision(name: str, batch: int = 1):
    import torch

    tv = import_torchvision()
    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
    model = tv.models.get_model(name, weights=None, **kwargs).eval()
    size = IMAGE_SIZES.get(name, 224)
    return model, (torch.randn(batch, 3, size, size),)


def _transformers(model_type: str, seq_len: int = SEQ_LEN):
    import torch

    from ..workloads.networks import _LastHidden

    transformers = import_transformers()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    try:
        model = transformers.AutoModel.from_config(config).eval()
    except Exception as err:  # a model type without a plain AutoModel (vision or audio inputs, ...)
        raise CwmError(f"transformers model type {model_type!r} has no AutoModel taking token ids: "
                       f"{type(err).__name__}") from None
    vocab = int(getattr(config, "vocab_size", 1000) or 1000)
    return _LastHidden(model), (torch.randint(0, min(vocab, 1000), (1, seq_len)),)


def _pt2(path: Path):
    import torch

    from .pytorch import load_pt2

    imported = load_pt2(path)

    class Exported(torch.nn.Module):
        """An exported program's module as an eval-mode ``nn.Module`` (its own ``eval()`` raises)."""

        cwm_family = imported.family  # for cwm.deploy.check.tolerance_for

        def __init__(self, inner):
            super().__init__()
            object.__setattr__(self, "inner", inner)  # not a child: train()/eval() would reach it

        def forward(self, *args):
            return self.inner(*args)

        def state_dict(self, *args, **kwargs):
            return self.inner.state_dict(*args, **kwargs)

    return Exported(imported.torch_model).eval(), tuple(torch.from_numpy(x) for x in imported.example_inputs)


def resolve(name: str):
    """(kind, loader) for a network name: ``torchvision:NAME``, ``transformers:TYPE``, a ``.pt2`` path, or a
    bare torchvision name or transformers model type. CwmError for anything else."""
    kind, sep, rest = name.partition(":")
    if sep and kind in ("torchvision", "transformers"):
        known = torchvision_names() if kind == "torchvision" else transformers_types()
        if rest not in known:
            raise CwmError(f"{kind} has no model {rest!r}")
        return kind, (lambda: _torchvision(rest)) if kind == "torchvision" else (lambda: _transformers(rest))
    if name.endswith(".onnx"):
        raise CwmError(f"{name}: cwm bench e2e times PyTorch contenders and needs a PyTorch model; give a .pt2 "
                       "file (torch.export.save), or use `cwm tune`, `cwm build` and `cwm run` for an ONNX file")
    if name.endswith(".pt2"):
        if not Path(name).is_file():
            raise CwmError(f"model file {name} does not exist")
        return "file", lambda: _pt2(Path(name))
    if name in torchvision_names():
        return "torchvision", lambda: _torchvision(name)
    if name in transformers_types():
        return "transformers", lambda: _transformers(name)
    raise CwmError(f"unknown network {name!r}: not a built-in network, a torchvision model, a transformers model "
                   "type or a .pt2 file (see docs/deployment.md)")
