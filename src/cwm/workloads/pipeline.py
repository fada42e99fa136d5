"""The Relax pipeline: any torch model -> Relax, rewrites, fusion and MetaSchedule task extraction."""

from __future__ import annotations

import logging
import re

from ..errors import CwmError, first_line
from ..hardware import as_target
from ..schedule.tir import block_names
from .task import Task, kind_of

log = logging.getLogger(__name__)


def relax_from_torch(model, example_inputs, target=None, *, bind_params: bool = True):
    """Export a PyTorch model to Relax with its parameters bound, ready for fusion and tuning.

    ``torch.export`` -> ``relax_from_exported``. The model is put in eval mode.
    """
    import torch

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    model = model.eval()
    try:
        with torch.no_grad():
            exported = torch.export.export(model, tuple(example_inputs))
    except Exception as err:  # export raises many error types
        raise CwmError(f"cannot import {type(model).__name__} into Relax: {first_line(err)}") from err
    return relax_from_exported(exported, target, bind_params=bind_params, name=type(model).__name__)


UNSUPPORTED_TORCH_OPS = re.compile(r"Unsupported function types \[(.*?)\]")


def relax_from_exported(exported, target=None, *, bind_params: bool = True, name: str = "the model"):
    """A ``torch.export.ExportedProgram`` in Relax with its parameters bound (``simplify_relax``).

    ``from_exported_program`` -> bind the weights as constants -> ``simplify_relax``. An operator
    TVM's PyTorch frontend does not convert is a ``CwmError`` that names it.
    """
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    try:
        mod = from_exported_program(exported, keep_params_as_input=True)
    except Exception as err:  # the frontend raises many error types
        found = UNSUPPORTED_TORCH_OPS.search(str(err))
        if found:
            ops = ", ".join(sorted(o.strip(" '\"") for o in found.group(1).split(",")))
            raise CwmError(f"TVM's PyTorch frontend does not support the operator(s) {ops} of {name}") from err
        raise CwmError(f"cannot import {name} into Relax: {first_line(err)}") from err
    mod, params = relax.frontend.detach_params(mod)
    if bind_params and params.get("main"):
        fparams = mod["main"].params
        weights = params["main"]
        bound = dict(zip(fparams[len(fparams) - len(weights):], weights))
        mod = relax.transform.BindParams("main", bound)(mod)
    return simplify_relax(mod, target)


def simplify_relax(mod, target=None):
    """``FoldBatchnormToConv2D`` (an eval-mode batch norm right after a convolution scales its weights;
    torchvision's convolutions before a batch norm have no bias) -> ``DecomposeOpsForInference`` (the
    other batch norms become elementwise arithmetic) -> ``CanonicalizeBindings`` -> ``FoldConstant``
    (the scaled weights become constants): no ``batch_norm`` op is left, and what is not folded into
    the weights FuseOps puts in the convolution's epilogue. Every frontend's module (PyTorch, ONNX)
    goes through it."""
    import tvm
    from tvm import relax

    with as_target(target):
        return tvm.transform.Sequential(
            [
                relax.transform.FoldBatchnormToConv2D(),
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                relax.transform.FoldConstant(),
            ]
        )(mod)


def _kind_for(task: Task) -> str:
    short = task.name.split("/", 1)[1]
    kind = kind_of(short)
    if kind == "conv2d" and _is_depthwise(task.mod):
        return "depthwise_conv2d"
    if kind == "matmul" and "add" in short:
        return "dense"
    return kind


def _is_depthwise(mod) -> bool:
    """A grouped conv with one input channel per group (Relax legalizes it as group_conv2d)."""
    return any(name.startswith("group_conv2d") or name.startswith("DepthwiseConv2d") for name in block_names(mod))


def relax_op_counts(mod) -> dict[str, int]:
    """How many times each Relax operator is called in ``main`` (e.g. to see batch norm is gone)."""
    import tvm

    counts: dict[str, int] = {}
    for call in _calls_in(mod["main"]):
        if isinstance(call.op, tvm.ir.Op):
            counts[str(call.op.name)] = counts.get(str(call.op.name), 0) + 1
    return counts


def _calls_in(func) -> list:
    """Every Relax call in ``func``'s body."""
    from tvm import relax

    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    return calls


_COMPARE_OPS = ("relax.equal", "relax.not_equal", "relax.less", "relax.less_equal", "relax.greater",
                "relax.greater_equal")


def _dtype_of(expr) -> str | None:
    t = getattr(expr, "ty", None) or getattr(expr, "struct_info", None)
    dtype = getattr(t, "dtype", None)
    return None if dtype is None else str(dtype)


def _rewrite_calls(mod, rewrite, what: str):
    """Apply ``rewrite(builder, call)`` bottom-up to every call in the module's Relax functions.

    ``rewrite`` returns the replacement expression, or None to keep the call. Returns ``mod``
    itself (the same object) when nothing was replaced.
    """
    from tvm import relax
    from tvm.relax import PyExprMutator, expr_functor

    changed = []

    @expr_functor.mutator
    class Rewriter(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            new = rewrite(self.builder_, call)
            if new is None:
                return call
            changed.append(call.op.name)
            return new

    rewriter = Rewriter(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    if not changed:
        return mod
    log.debug("%s: rewrote %d op(s): %s", what, len(changed), sorted(set(changed)))
    return rewriter.builder_.get()


def rewrite_bool_ops(mod):
    """Work around two bool-tensor gaps of TVM 0.27 that stop GPT-2 from compiling on CPU.

    * ``R.cumsum`` of a bool tensor with no dtype: the torch frontend types the result bool, and
      the LLVM codegen then aborts on a bool add. PyTorch defines the sum of bools as an int64
      count, so it becomes ``R.cumsum(x, dtype="int64")``; the ops that use it are re-typed.
    * Comparisons of two bool tensors (``R.equal`` ...): the LLVM codegen emits a float compare
      (``fcmp oeq i1``) and aborts. Both operands are cast to int8 first (exact).

    transformers' attention-mask code (``find_packed_sequence_indices``: a cumsum over a bool mask,
    then ``==``) has both. Only the small elementwise mask subgraphs change, never a tuned task;
    other models come back unchanged.
    """
    from tvm import relax

    text = mod.script()
    if "R.cumsum" not in text and not any(op in text for op in ("R.equal", "R.not_equal", "R.less", "R.greater")):
        return mod

    def rewrite(builder, call):
        op = getattr(call.op, "name", None)
        if op == "relax.cumsum" and _dtype_of(call.args[0]) == "bool" and _dtype_of(call) in (None, "bool"):
            attrs = call.attrs
            return relax.op.cumsum(call.args[0], axis=attrs.axis, dtype="int64", exclusive=bool(attrs.exclusive))
        if op in _COMPARE_OPS and all(_dtype_of(a) == "bool" for a in call.args):
            return relax.Call(call.op, [relax.op.astype(a, "int8") for a in call.args], call.attrs)
        return None

    return _rewrite_calls(mod, rewrite, "bool ops")


FAST_MATH_UNARY_OPS = ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.erf", "relax.tanh")
# Bump when fused_module changes which subgraphs a network has: cached builds keyed on it are stale.
PIPELINE_VERSION = 5  # 2: rewrite_fast_math; 3: weight prepacking on CPU; 4: NHWC convolutions on CPU;
# 5: batch norms folded into convolution weights


def fast_math_counts(mod) -> dict[str, int]:
    """How many calls of each op ``rewrite_fast_math`` replaces in ``mod``'s ``main``."""
    counts: dict[str, int] = {}
    for call in _calls_in(mod["main"]):
        if _fast_math_rewrites(call):
            counts[call.op.name] = counts.get(call.op.name, 0) + 1
    return counts


def _fast_math_rewrites(call) -> bool:
    """Whether ``rewrite_fast_math`` replaces this call."""
    op = getattr(call.op, "name", None)
    if op in FAST_MATH_UNARY_OPS:
        return _dtype_of(call.args[0]) == "float32"
    return op == "relax.power" and _small_power(call) is not None


def _small_power(call) -> int | None:
    """The exponent of ``R.power(x, c)`` when ``c`` is the scalar constant 2 or 3, else None."""
    from tvm.ir.expr import GenericConst

    base, exponent = call.args
    if not isinstance(exponent, GenericConst) or _dtype_of(base) != "float32":
        return None
    value = exponent.value.numpy()
    if value.size != 1 or float(value.reshape(-1)[0]) not in (2.0, 3.0):
        return None
    return int(value.reshape(-1)[0])


def rewrite_fast_math(mod):
    """Give float32 GELU, erf, tanh and ``x ** 2``, ``x ** 3`` code that vectorizes.

    Legalized as they are, these call libm (``erff``, ``tanhf``'s ``expf``, ``powf``) once per
    element, which LLVM cannot vectorize: BERT's GELU subgraph took 3.5 ms a call on Zen 3 however
    it was scheduled (12 calls, 17% of the network) and GPT-2's ``gelu_new`` (``pow`` and ``tanh``)
    43% of the network on a Xeon. ``erf`` and ``tanh`` become TOPI's rational approximations
    (``topi.fast_erf``, ``topi.fast_tanh``, Eigen's float kernels, a few ulp); powers become
    multiplications. Other dtypes and ops are left alone. Returns the module unchanged (the same
    object) when there is nothing to rewrite.
    """
    import math as _math

    from tvm import relax, te, tirx, topi

    def gelu(x: te.Tensor):
        half = tirx.const(0.5, x.dtype)
        return x * (half + topi.fast_erf(x * tirx.const(0.5 ** 0.5, x.dtype)) * half)

    def gelu_tanh(x: te.Tensor):
        c = tirx.const(_math.sqrt(2.0 / _math.pi), x.dtype)
        inner = c * x * (tirx.const(1.0, x.dtype) + tirx.const(0.044715, x.dtype) * x * x)
        return tirx.const(0.5, x.dtype) * x * (tirx.const(1.0, x.dtype) + topi.fast_tanh(inner))

    unary = {"relax.nn.gelu": (gelu, "gelu"), "relax.nn.gelu_tanh": (gelu_tanh, "gelu_tanh"),
             "relax.erf": (topi.fast_erf, "erf"), "relax.tanh": (topi.fast_tanh, "tanh")}

    def rewrite(builder, call):
        if not _fast_math_rewrites(call):
            return None
        if call.op.name in unary:
            fn, hint = unary[call.op.name]
            return builder.call_te(fn, call.args[0], primfunc_name_hint=hint)
        x = call.args[0]
        square = relax.op.multiply(x, x)
        return square if _small_power(call) == 2 else relax.op.multiply(square, x)

    return _rewrite_calls(mod, rewrite, "fast math")


def _scalar_value(expr) -> float | None:
    """The number of a scalar immediate (``FloatImm``/``IntImm``, possibly wrapped), else None."""
    value = getattr(expr, "value", None)
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) else None


def rewrite_clip(mod):
    """``clip(x, lo, hi)`` as ``minimum(maximum(x, lo), hi)``: ``ConvertLayout`` has no layout rule
    for ``relax.clip``, so MobileNet's ReLU6 would otherwise be wrapped in two transposes per call."""
    from tvm import relax

    def rewrite(builder, call):
        if getattr(call.op, "name", None) != "relax.clip":
            return None
        x, lo, hi = call.args
        bounds = [_scalar_value(v) for v in (lo, hi)]
        dtype = _dtype_of(x)
        if dtype is None or None in bounds:
            return None
        low, high = (relax.const(v, dtype) for v in bounds)
        return relax.op.minimum(relax.op.maximum(x, low), high)

    return _rewrite_calls(mod, rewrite, "clip")


def default_weight_prepack(target) -> bool:
    """Weight prepacking is on for CPU targets: MetaSchedule's ``RewriteLayout`` postprocessor is
    part of the LLVM defaults and lays constant weights out in the order the tuned loops read them."""
    return as_target(target).kind.name == "llvm"


CONV_LAYOUTS = ("NCHW", "NHWC")
_CONV_BLOCK = re.compile(r"(?:group_)?conv2d_(nchw|nhwc)")


def default_conv_layout(target) -> str:
    """NHWC on CPU targets: the output channels are contiguous, so MetaSchedule's tiles vectorize
    along them. In NCHW the innermost output axis is the image width (7-56 in ResNet-50): on Zen 3,
    two of ResNet-50's heaviest 3x3 convolutions tuned 1.8-2.6x faster at the same 32 trials in NHWC."""
    return "NHWC" if as_target(target).kind.name == "llvm" else "NCHW"


def conv_layout_of(prim_mod) -> str | None:
    """The data layout of a task's 2-D convolution ("NCHW" or "NHWC"), None if it has none."""
    for name in block_names(prim_mod):
        found = _CONV_BLOCK.fullmatch(name)
        if found:
            return found.group(1).upper()
    return None


def fused_module(mod, target, weight_prepack: bool | None = None, conv_layout: str | None = None):
    """The zero pipeline without the database: LegalizeOps, AnnotateTIROpPattern, FoldConstant,
    FuseOps, FuseTIR (after ``rewrite_bool_ops`` and ``rewrite_fast_math``). Its PrimFuncs are the
    tasks MetaSchedule extracts and tunes.

    With ``weight_prepack`` (default: ``default_weight_prepack(target)``), the PrimFuncs name their
    constant (weight) arguments in a ``layout_free_buffers`` attribute, so the tuned schedules may
    change those buffers' layout; ``build_network`` then folds the layout change into the constants.
    ``conv_layout`` (default: ``default_conv_layout(target)``) is the data layout of 2-D
    convolutions; for NHWC, ``ConvertLayout`` changes them and the ops between them, and inserts
    transposes where the layout has to change back (the network's inputs and outputs stay as they are).
    """
    import tvm
    from tvm import relax

    target = as_target(target)
    if weight_prepack is None:
        weight_prepack = default_weight_prepack(target)
    if conv_layout is None:
        conv_layout = default_conv_layout(target)
    if conv_layout not in CONV_LAYOUTS:
        raise CwmError(f"unknown convolution layout {conv_layout!r}; choose one of {', '.join(CONV_LAYOUTS)}")
    mod = rewrite_fast_math(rewrite_bool_ops(mod))
    passes = []
    if conv_layout == "NHWC":
        mod = rewrite_clip(mod)
        passes.append(relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}))
    passes.append(relax.get_pipeline("zero"))
    if weight_prepack:
        passes.append(relax.transform.AttachAttrLayoutFreeBuffers())
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(passes)(mod)


def extract_tasks(mod, target, network: str | None = None, weight_prepack: bool | None = None,
                  conv_layout: str | None = None) -> list:
    """The MetaSchedule tasks of a (not yet fused) Relax module, as ``cwm.workloads.Task``."""
    import tvm.s_tir.meta_schedule as ms

    from ..workloads import Task

    target = as_target(target)
    fused = fused_module(mod, target, weight_prepack, conv_layout)
    tasks = []
    for ext in ms.relax_integration.extract_tasks(fused, target):
        name = f"{network}/{ext.task_name}" if network else str(ext.task_name)
        tasks.append(Task(name=name, mod=ext.dispatched[0], weight=float(ext.weight), network=network))
    try:  # the network helper knows depthwise convs and dense layers; fall back to the name heuristic
        from .pipeline import _kind_for

        for t in tasks:
            if "/" in t.name:
                t.kind = _kind_for(t)
    except ImportError:
        pass
    return tasks
