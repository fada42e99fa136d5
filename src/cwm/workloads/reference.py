"""The reference task set of the committed dataset: 5 networks plus the operator registry.

Ordered so that operator kinds interleave: a collection cut short still covers every kind.
"""
from .resolve import resolve_task

REFERENCE_TASKS = [
    "bert-base/fused_matmul_add2",
    "resnet18/fused_conv2d1_subtract1_divide1_multiply1_add1_relu1",
    "mobilenet_v2/fused_conv2d7_subtract5_divide5_multiply5_add5_tir_clip3",
    "batch_matmul:B=12,M=128,N=128,K=64",
    "softmax:M=1536,N=128",
    "gpt2/fused_matmul_add2",
    "resnet50/fused_conv2d13_subtract8_divide8_multiply8_add10_add11_relu8",
    "depthwise_conv2d:N=1,C=144,H=56,W=56,R=3,stride=1,pad=1",
    "bert-base/matmul1",
    "layernorm:M=128,N=768",
    "matmul:M=512,N=512,K=512",
    "mobilenet_v2/fused_conv2d3_subtract2_divide2_multiply2_add2_tir_clip1",
    "max_pool2d:N=1,C=64,H=112,W=112,R=3,stride=2,pad=1",
    "dense_gelu:M=64,N=1024,K=256",
    "resnet18/fused_conv2d9_subtract4_divide4_multiply4_add7_add8_relu4",
    "mobilenet_v2/fused_conv2d1_subtract_divide_multiply_add_tir_clip",
    "gpt2/fused_softmax_cast2_tir_logical_not1_where1_broadcast_to4",
    "conv2d:N=1,C=256,H=14,W=14,K=256,R=3,stride=1,pad=1",
    "bert-base/layer_norm",
    "dense_relu:M=128,N=512,K=256",
    "resnet50/fused_conv2d15_subtract7_divide7_multiply7_add9_relu7",
    "batch_matmul:B=16,M=64,N=64,K=64",
    "mobilenet_v2/fused_conv2d17_subtract11_divide11_multiply11_add13_tir_clip7",
    "matmul:M=128,N=128,K=128",
    # GPT-2's GELU. The committed dataset holds its earlier form, with libm pow and tanh, as
    # "gpt2/fused_reshape12_multiply2_power_multiply3_add6_multiply4_tir_tanh_add7_multiply5_reshape13";
    # `cwm.workloads.pipeline.rewrite_fast_math` now gives the network this one.
    "gpt2/fused_reshape12_multiply2_multiply3_multiply3_multiply4_add6_multiply5_tanh_add7_multiply3_reshape13",
    "resnet18/fused_conv2d_subtract_divide_multiply_add_relu",
    "mobilenet_v2/fused_conv2d20_subtract13_divide13_multiply13_add16_tir_clip8",
    "softmax:M=768,N=256",
    "conv2d_bias_relu:N=1,C=128,H=28,W=28,K=128,R=3,stride=1,pad=1",
    "bert-base/matmul2",
    "depthwise_conv2d:N=1,C=384,H=14,W=14,R=3,stride=1,pad=1",
    "avg_pool2d:N=1,C=256,H=28,W=28,R=2,stride=2,pad=0",
    "matmul:M=256,N=1000,K=512",
    "mobilenet_v2/fused_conv2d4_subtract3_divide3_multiply3_add3_tir_clip2",
    "batch_matmul:B=12,M=128,N=64,K=128",
    "resnet18/fused_conv2d3_subtract2_divide2_multiply2_add3_add4_relu2",
    "conv2d:N=1,C=64,H=56,W=56,K=64,R=3,stride=1,pad=0",
    "depthwise_conv2d:N=1,C=96,H=112,W=112,R=3,stride=2,pad=1",
    "matmul:M=1024,N=1024,K=1024",
    "matmul:M=1024,N=1023,K=1024",
    # The gpt2 GELU task's design space has under 100 distinct schedules; this one makes 40
    # tasks with 200+ valid records.
    "dense:M=128,N=768,K=768",
]

# Further tasks of the same networks, for a larger collection when time allows.
EXTRA_TASKS = [
    "mobilenet_v2/fused_conv2d6_subtract5_divide5_multiply5_add5_tir_clip3",
    "conv2d_bias_relu:N=1,C=3,H=224,W=224,K=64,R=7,stride=2,pad=3",
    "resnet50/fused_conv2d22_subtract10_divide10_multiply10_add13_relu10",
    "dense:M=1,N=1000,K=2048",
    "dense_relu:M=1,N=4096,K=9216",
    "resnet50/fused_conv2d7_subtract5_divide5_multiply5_add6_add7_relu5",
    "layernorm:M=256,N=1024",
]


# The search benchmark's subgraphs: held out of every committed training split (split v2 forces
# them into its test set; none is in a shipped model's training split), and of every kind:
# matmul/dense with epilogues, 1-D/2-D/3-D, grouped, dilated, depthwise and transposed
# convolutions, pooling and reductions.
HELD_OUT_SUBGRAPHS = (
    "matmul:M=1024,N=1023,K=1024",
    "dense_silu:M=128,N=2048,K=512",
    "dense_silu:M=256,N=1024,K=1024",
    "conv1d:N=1,C=256,L=512,K=256,R=3,stride=1,pad=1",
    "conv1d:N=1,C=512,L=256,K=512,R=3,stride=2,pad=1",
    "group_conv2d:N=1,C=256,H=28,W=28,K=256,R=3,stride=1,pad=1,groups=32",
    "group_conv2d:N=1,C=512,H=14,W=14,K=512,R=3,stride=1,pad=1,groups=32",
    "dilated_conv2d:N=1,C=256,H=32,W=32,K=256,R=3,stride=1,pad=2,dilation=2",
    "depthwise_conv2d:N=1,C=96,H=112,W=112,R=3,stride=2,pad=1",
    "conv2d_transpose:N=1,C=256,H=14,W=14,K=128,R=4,stride=2,pad=1",
    "conv3d:N=1,C=64,D=4,H=28,W=28,K=64,R=3,stride=1,pad=1",
    "max_pool2d:N=1,C=64,H=112,W=112,R=3,stride=2,pad=1",
    "reduce_sum:M=1024,N=1024",
    "reduce_max:M=512,N=512",
)


def reference_tasks(target=None):
    return [resolve_task(name, target) for name in REFERENCE_TASKS]
