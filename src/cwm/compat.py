"""Import fixes for the pinned wheels."""

from __future__ import annotations


def import_torchvision():
    """Import torchvision beside the CPU torch wheel.

    The PyPI torchvision 0.28 wheel is a CUDA build whose C++ ops fail to register against
    CPU torch; its Python import then fails on the missing ``torchvision::nms`` schema.
    Defining the two schemas first lets the model definitions import.
    """
    import torch

    try:
        import torchvision

        return torchvision
    except (RuntimeError, ImportError, OSError) as err:
        if "torchvision::nms" not in str(err):
            raise
    import sys

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    if not getattr(import_torchvision, "_schemas_defined", False):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        import_torchvision._library = lib  # keep the registration alive
        import_torchvision._schemas_defined = True
    import torchvision

    return torchvision


def import_transformers():
    """Import transformers; it imports torchvision, which needs the fix above first."""
    import_torchvision()
    import transformers

    return transformers
