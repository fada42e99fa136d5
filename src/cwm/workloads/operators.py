"""Operator registry: named, parameterized subgraphs with shapes taken from real networks.

A workload is written ``op`` (its default shape) or ``op:KEY=VALUE,KEY=VALUE`` where
unspecified keys keep their defaults, e.g. ``dense_relu:M=128,N=3072,K=768``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import CwmError
from .task import Task


def _te():
    from tvm import te, tirx, topi

    return te, tirx, topi


def _prim(args, name: str):
    import tvm
    from tvm import te

    func = te.create_prim_func(args).with_attr("global_symbol", "main")
    return tvm.IRModule({"main": func})


def matmul(M, N, K):
    te, _, _ = _te()
    A = te.placeholder((M, K), name="A")
    B = te.placeholder((K, N), name="B")
    k = te.reduce_axis((0, K), name="k")
    C = te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


def _dense(M, N, K, act):
    te, tirx, _ = _te()
    X = te.placeholder((M, K), name="X")
    W = te.placeholder((N, K), name="W")
    bias = te.placeholder((N,), name="bias")
    k = te.reduce_axis((0, K), name="k")
    Y = te.compute((M, N), lambda i, j: te.sum(X[i, k] * W[j, k], axis=k), name="Y")
    Z = te.compute((M, N), lambda i, j: Y[i, j] + bias[j], name="Z")
    if act == "relu":
        Z = te.compute((M, N), lambda i, j: te.max(Z[i, j], 0.0), name="relu")
    elif act == "gelu":
        Z = te.compute(
            (M, N),
            lambda i, j: Z[i, j] * 0.5 * (1.0 + tirx.erf(Z[i, j] * (1.0 / math.sqrt(2.0)))),
            name="gelu",
        )
    return [X, W, bias, Z]


def dense(M, N, K):
    return _dense(M, N, K, None)


def dense_relu(M, N, K):
    return _dense(M, N, K, "relu")


def dense_gelu(M, N, K):
    return _dense(M, N, K, "gelu")


def batch_matmul(B, M, N, K):
    te, _, _ = _te()
    X = te.placeholder((B, M, K), name="X")
    Y = te.placeholder((B, K, N), name="Y")
    k = te.reduce_axis((0, K), name="k")
    Z = te.compute((B, M, N), lambda b, i, j: te.sum(X[b, i, k] * Y[b, k, j], axis=k), name="Z")
    return [X, Y, Z]


def _conv(N, C, H, W, K, R, stride, pad, epilogue):
    te, _, topi = _te()
    data = te.placeholder((N, C, H, W), name="data")
    weight = te.placeholder((K, C, R, R), name="weight")
    out = topi.nn.conv2d_nchw(data, weight, stride, pad, 1)
    args = [data, weight]
    if epilogue:
        bias = te.placeholder((1, K, 1, 1), name="bias")
        out = topi.nn.relu(topi.add(out, bias))
        args.append(bias)
    return args + [out]


def conv2d(N, C, H, W, K, R, stride, pad):
    return _conv(N, C, H, W, K, R, stride, pad, False)


def conv2d_bias_relu(N, C, H, W, K, R, stride, pad):
    return _conv(N, C, H, W, K, R, stride, pad, True)


def depthwise_conv2d(N, C, H, W, R, stride, pad):
    te, _, topi = _te()
    data = te.placeholder((N, C, H, W), name="data")
    weight = te.placeholder((C, 1, R, R), name="weight")
    out = topi.nn.depthwise_conv2d_nchw(data, weight, stride, pad, 1)
    return [data, weight, out]


def _pool(N, C, H, W, R, stride, pad, kind):
    te, _, topi = _te()
    data = te.placeholder((N, C, H, W), name="data")
    out = topi.nn.pool2d(data, (R, R), (stride, stride), (1, 1), (pad, pad, pad, pad), kind)
    return [data, out]


def max_pool2d(N, C, H, W, R, stride, pad):
    return _pool(N, C, H, W, R, stride, pad, "max")


def avg_pool2d(N, C, H, W, R, stride, pad):
    return _pool(N, C, H, W, R, stride, pad, "avg")


def softmax(M, N):
    te, _, topi = _te()
    x = te.placeholder((M, N), name="x")
    return [x, topi.nn.softmax(x, axis=-1)]


def layernorm(M, N):
    te, _, topi = _te()
    x = te.placeholder((M, N), name="x")
    gamma = te.placeholder((N,), name="gamma")
    beta = te.placeholder((N,), name="beta")
    return [x, gamma, beta, topi.nn.layer_norm(x, gamma, beta, axis=[1], epsilon=1e-5)]


def conv1d(N, C, L, K, R, stride, pad):
    te, _, topi = _te()
    data = te.placeholder((N, C, L), name="data")
    weight = te.placeholder((K, C, R), name="weight")
    return [data, weight, topi.nn.conv1d_ncw(data, weight, stride, pad, 1)]


def conv3d(N, C, D, H, W, K, R, stride, pad):
    te, _, topi = _te()
    data = te.placeholder((N, C, D, H, W), name="data")
    weight = te.placeholder((K, C, R, R, R), name="weight")
    return [data, weight, topi.nn.conv3d_ncdhw(data, weight, stride, pad, 1, 1)]


def group_conv2d(N, C, H, W, K, R, stride, pad, groups):
    te, _, topi = _te()
    if C % groups or K % groups:
        raise ValueError(f"groups={groups} must divide C={C} and K={K}")
    data = te.placeholder((N, C, H, W), name="data")
    weight = te.placeholder((K, C // groups, R, R), name="weight")
    return [data, weight, topi.nn.group_conv2d_nchw(data, weight, stride, pad, 1, groups)]


def dilated_conv2d(N, C, H, W, K, R, stride, pad, dilation):
    te, _, topi = _te()
    data = te.placeholder((N, C, H, W), name="data")
    weight = te.placeholder((K, C, R, R), name="weight")
    return [data, weight, topi.nn.conv2d_nchw(data, weight, stride, pad, dilation)]


def conv2d_transpose(N, C, H, W, K, R, stride, pad):
    te, _, topi = _te()
    data = te.placeholder((N, C, H, W), name="data")
    weight = te.placeholder((C, K, R, R), name="weight")
    return [data, weight, topi.nn.conv2d_transpose_nchw(data, weight, (stride, stride), (pad, pad), "float32", (0, 0))]


def _reduce(M, N, kind):
    te, _, topi = _te()
    x = te.placeholder((M, N), name="x")
    return [x, getattr(topi, kind)(x, axis=1)]


def reduce_sum(M, N):
    return _reduce(M, N, "sum")


def reduce_max(M, N):
    return _reduce(M, N, "max")


def argmax(M, N):
    return _reduce(M, N, "argmax")


def global_avg_pool2d(N, C, H, W):
    te, _, topi = _te()
    data = te.placeholder((N, C, H, W), name="data")
    return [data, topi.nn.global_pool(data, "avg")]


def dense_silu(M, N, K):
    te, tirx, _ = _te()
    X, W, bias, Z = _dense(M, N, K, None)
    out = te.compute((M, N), lambda i, j: Z[i, j] * tirx.sigmoid(Z[i, j]), name="silu")
    return [X, W, bias, out]


# The largest tensor a workload may have: 2**31 elements (8 GiB of float32). Larger ones cannot be
# allocated for measurement on the machines this runs on; the largest registry tensor has ~4e7.
MAX_TENSOR_ELEMENTS = 2**31


@dataclass(frozen=True)
class Operator:
    name: str
    build: object
    defaults: dict
    source: str  # the network the default shape comes from

    def task(self, **overrides) -> Task:
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise CwmError(
                f"{self.name} has no parameter {sorted(unknown)[0]!r}; it takes {', '.join(self.defaults)}"
            )
        params = {**self.defaults, **overrides}
        for key, value in params.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise CwmError(f"{self.name}: {key} must be an integer, got {value!r}")
            minimum = 0 if key == "pad" else 1
            if value < minimum:
                raise CwmError(f"{self.name}: {key} must be >= {minimum}, got {value}")
            if value > 1 << 20:
                raise CwmError(f"{self.name}: {key}={value} is too large (max {1 << 20})")
        try:
            tensors = self.build(**params)
            for t in tensors:
                dims = [int(d) for d in t.shape]
                if min(dims, default=1) <= 0:
                    raise CwmError(f"{self.name} with {params} is not a valid shape: tensor {t.op.name} "
                                   f"would have shape {dims}")
                elements = math.prod(dims)
                if elements > MAX_TENSOR_ELEMENTS:
                    raise CwmError(f"{self.name} with {params}: tensor {t.op.name} would hold {elements:.3g} elements "
                                   f"({elements * 4 / 2**30:.0f} GiB); at most {MAX_TENSOR_ELEMENTS:.3g} are allowed")
            mod = _prim(tensors, self.name)
        except CwmError:
            raise
        except Exception as err:
            raise CwmError(f"{self.name} with {params} is not a valid shape: {err}") from err
        name = self.name + ":" + ",".join(f"{k}={v}" for k, v in params.items())
        return Task(name=name, mod=mod, params=params, kind=_KIND_OF_OPERATOR[self.name])


_KIND_OF_OPERATOR = {
    "matmul": "matmul",
    "dense": "dense",
    "dense_relu": "dense",
    "dense_gelu": "dense",
    "batch_matmul": "batch_matmul",
    "conv2d": "conv2d",
    "conv2d_bias_relu": "conv2d",
    "depthwise_conv2d": "depthwise_conv2d",
    "max_pool2d": "pool",
    "avg_pool2d": "pool",
    "softmax": "softmax",
    "layernorm": "layernorm",
    "conv1d": "conv1d",
    "conv3d": "conv3d",
    "group_conv2d": "group_conv2d",
    "dilated_conv2d": "conv2d",
    "conv2d_transpose": "conv2d_transpose",
    "reduce_sum": "reduction",
    "reduce_max": "reduction",
    "argmax": "reduction",
    "global_avg_pool2d": "pool",
    "dense_silu": "dense",
}

OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in [
        Operator("matmul", matmul, {"M": 512, "N": 512, "K": 512}, "square GEMM"),
        Operator("dense", dense, {"M": 128, "N": 768, "K": 768}, "bert-base attention output"),
        Operator("dense_relu", dense_relu, {"M": 1, "N": 4096, "K": 9216}, "alexnet/vgg classifier"),
        Operator("dense_gelu", dense_gelu, {"M": 128, "N": 3072, "K": 768}, "bert-base FFN"),
        Operator("batch_matmul", batch_matmul, {"B": 12, "M": 128, "N": 128, "K": 64}, "bert-base attention"),
        Operator("conv2d", conv2d, {"N": 1, "C": 64, "H": 56, "W": 56, "K": 64, "R": 3, "stride": 1, "pad": 1},
                 "resnet18 layer1"),
        Operator("conv2d_bias_relu", conv2d_bias_relu,
                 {"N": 1, "C": 128, "H": 28, "W": 28, "K": 128, "R": 3, "stride": 1, "pad": 1}, "resnet18 layer2"),
        Operator("depthwise_conv2d", depthwise_conv2d,
                 {"N": 1, "C": 144, "H": 56, "W": 56, "R": 3, "stride": 1, "pad": 1}, "mobilenet_v2 block"),
        Operator("max_pool2d", max_pool2d, {"N": 1, "C": 64, "H": 112, "W": 112, "R": 3, "stride": 2, "pad": 1},
                 "resnet stem"),
        Operator("avg_pool2d", avg_pool2d, {"N": 1, "C": 256, "H": 28, "W": 28, "R": 2, "stride": 2, "pad": 0},
                 "densenet transition"),
        Operator("softmax", softmax, {"M": 1536, "N": 128}, "bert-base attention scores"),
        Operator("layernorm", layernorm, {"M": 128, "N": 768}, "bert-base"),
        Operator("conv1d", conv1d, {"N": 1, "C": 256, "L": 512, "K": 256, "R": 3, "stride": 1, "pad": 1},
                 "wav2vec-style audio encoder"),
        Operator("conv3d", conv3d, {"N": 1, "C": 64, "D": 4, "H": 28, "W": 28, "K": 64, "R": 3, "stride": 1, "pad": 1},
                 "r3d-18 video block"),
        Operator("group_conv2d", group_conv2d,
                 {"N": 1, "C": 256, "H": 28, "W": 28, "K": 256, "R": 3, "stride": 1, "pad": 1, "groups": 32},
                 "resnext50 layer2"),
        Operator("dilated_conv2d", dilated_conv2d,
                 {"N": 1, "C": 256, "H": 32, "W": 32, "K": 256, "R": 3, "stride": 1, "pad": 2, "dilation": 2},
                 "deeplabv3 ASPP"),
        Operator("conv2d_transpose", conv2d_transpose,
                 {"N": 1, "C": 256, "H": 14, "W": 14, "K": 128, "R": 4, "stride": 2, "pad": 1}, "DCGAN/U-Net decoder"),
        Operator("reduce_sum", reduce_sum, {"M": 1024, "N": 1024}, "row sums"),
        Operator("reduce_max", reduce_max, {"M": 1536, "N": 128}, "softmax's max"),
        Operator("argmax", argmax, {"M": 128, "N": 32000}, "language-model head"),
        Operator("global_avg_pool2d", global_avg_pool2d, {"N": 1, "C": 2048, "H": 7, "W": 7}, "resnet50 head"),
        Operator("dense_silu", dense_silu, {"M": 128, "N": 2048, "K": 512}, "swish FFN"),
    ]
}


def parse_workload(spec: str) -> tuple[str, dict]:
    """Split ``op:K=V,...`` into the operator name and integer overrides."""
    name, _, rest = spec.strip().partition(":")
    if name not in OPERATORS:
        raise CwmError(f"unknown workload {name!r}; known: {', '.join(OPERATORS)}")
    overrides = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CwmError(f"malformed shape {item!r} in {spec!r}; write KEY=VALUE, e.g. M=128")
        if key.strip() in overrides:
            raise CwmError(f"malformed shape {spec!r}: {key.strip()} is given twice")
        try:
            overrides[key.strip()] = int(value)
        except ValueError:
            raise CwmError(f"malformed shape {item!r} in {spec!r}: {value!r} is not an integer") from None
    return name, overrides


def get_task(spec: str) -> Task:
    name, overrides = parse_workload(spec)
    return OPERATORS[name].task(**overrides)


# Extra shapes of each operator, taken from real networks, used for data collection and
# to hold out unseen shapes.
SHAPE_PRESETS: dict[str, list[dict]] = {
    "matmul": [{"M": 128, "N": 128, "K": 128}, {"M": 1024, "N": 1024, "K": 1024}, {"M": 1024, "N": 1023, "K": 1024},
               {"M": 256, "N": 1000, "K": 512}],
    "dense": [{"M": 128, "N": 2304, "K": 768}, {"M": 1, "N": 1000, "K": 2048}],
    "dense_relu": [{"M": 128, "N": 512, "K": 256}],
    "dense_gelu": [{"M": 64, "N": 1024, "K": 256}],
    "batch_matmul": [{"B": 12, "M": 128, "N": 64, "K": 128}, {"B": 16, "M": 64, "N": 64, "K": 64}],
    "conv2d": [{"N": 1, "C": 256, "H": 14, "W": 14, "K": 256, "R": 3, "stride": 1, "pad": 1},
               {"N": 1, "C": 64, "H": 56, "W": 56, "K": 64, "R": 3, "stride": 1, "pad": 0}],
    "conv2d_bias_relu": [{"N": 1, "C": 3, "H": 224, "W": 224, "K": 64, "R": 7, "stride": 2, "pad": 3}],
    "depthwise_conv2d": [{"N": 1, "C": 384, "H": 14, "W": 14, "R": 3, "stride": 1, "pad": 1},
                         {"N": 1, "C": 96, "H": 112, "W": 112, "R": 3, "stride": 2, "pad": 1}],
    "max_pool2d": [],
    "avg_pool2d": [],
    "softmax": [{"M": 768, "N": 256}],
    "layernorm": [{"M": 256, "N": 1024}],
    "conv1d": [{"N": 1, "C": 128, "L": 1024, "K": 128, "R": 5, "stride": 1, "pad": 2},
               {"N": 1, "C": 512, "L": 256, "K": 512, "R": 3, "stride": 2, "pad": 1}],
    "conv3d": [{"N": 1, "C": 3, "D": 16, "H": 56, "W": 56, "K": 64, "R": 3, "stride": 1, "pad": 1},
               {"N": 1, "C": 128, "D": 4, "H": 14, "W": 14, "K": 128, "R": 3, "stride": 1, "pad": 1}],
    "group_conv2d": [{"N": 1, "C": 512, "H": 14, "W": 14, "K": 512, "R": 3, "stride": 1, "pad": 1, "groups": 32},
                     {"N": 1, "C": 128, "H": 56, "W": 56, "K": 128, "R": 3, "stride": 1, "pad": 1, "groups": 4}],
    "dilated_conv2d": [{"N": 1, "C": 512, "H": 16, "W": 16, "K": 256, "R": 3, "stride": 1, "pad": 4, "dilation": 4}],
    "conv2d_transpose": [{"N": 1, "C": 128, "H": 28, "W": 28, "K": 64, "R": 4, "stride": 2, "pad": 1},
                         {"N": 1, "C": 64, "H": 56, "W": 56, "K": 32, "R": 3, "stride": 1, "pad": 1}],
    "reduce_sum": [{"M": 128, "N": 3072}, {"M": 4096, "N": 256}],
    "reduce_max": [{"M": 512, "N": 512}],
    "argmax": [{"M": 1, "N": 50257}],
    "global_avg_pool2d": [{"N": 1, "C": 1280, "H": 7, "W": 7}, {"N": 1, "C": 512, "H": 14, "W": 14}],
    "dense_silu": [{"M": 64, "N": 1536, "K": 384}, {"M": 256, "N": 1024, "K": 1024}],
}


def registry_tasks(include_presets: bool = True) -> list[Task]:
    tasks = []
    for name, op in OPERATORS.items():
        tasks.append(op.task())
        if include_presets:
            tasks.extend(op.task(**preset) for preset in SHAPE_PRESETS.get(name, []))
    return tasks
