"""Real networks imported through torch.export and split into MetaSchedule tasks.

No weights are downloaded: torchvision models are built with ``weights=None`` and the
transformers models from their config classes with random initialization.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..compat import import_torchvision
from ..errors import CwmError
from ..hardware import make_target
from .pipeline import extract_tasks, relax_from_torch
from .task import Task

SEQ_LEN = 128


def _vision(name, batch: int = 1, size: int = 224, **kwargs):
    def build():
        import torch

        tv = import_torchvision()
        torch.manual_seed(0)  # the same random weights and inputs in every process
        model = getattr(tv.models, name)(weights=None, **kwargs).eval()
        return model, (torch.randn(batch, 3, size, size),)

    return build


def _transformer(config_class: str, model_class: str, seq_len: int = SEQ_LEN, **config):
    """A transformers encoder or decoder from its config class, random init, returning its last hidden state."""

    def build():
        import torch

        import_torchvision()  # transformers imports torchvision
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_class)(**config)
        model = getattr(transformers, model_class)(cfg).eval()
        return _LastHidden(model), (torch.randint(0, 1000, (1, seq_len)),)

    return build


def _bert():
    import torch

    import_torchvision()  # transformers imports torchvision
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(), add_pooling_layer=False).eval()
    return _LastHidden(model), (torch.randint(0, 1000, (1, SEQ_LEN)),)


def _gpt2():
    import torch

    import_torchvision()
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(use_cache=False)).eval()
    return _LastHidden(model), (torch.randint(0, 1000, (1, SEQ_LEN)),)


def _last_hidden_module():
    import torch

    class LastHidden(torch.nn.Module):
        """Return the last hidden state as a plain tensor, so export sees one output."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).last_hidden_state

    return LastHidden


def _LastHidden(model):
    return _last_hidden_module()(model).eval()


@dataclass(frozen=True)
class Network:
    name: str
    build: object  # () -> (torch.nn.Module, example_inputs)
    description: str


NETWORKS: dict[str, Network] = {
    n.name: n
    for n in [
        Network("resnet18", _vision("resnet18"), "torchvision ResNet-18, 1x3x224x224"),
        Network("resnet50", _vision("resnet50"), "torchvision ResNet-50, 1x3x224x224"),
        Network("mobilenet_v2", _vision("mobilenet_v2"), "torchvision MobileNetV2, 1x3x224x224"),
        Network("bert-base", _bert, f"BERT-base encoder (random init), sequence {SEQ_LEN}"),
        Network("gpt2", _gpt2, f"GPT-2 small decoder (random init), sequence {SEQ_LEN}"),
        # Networks for the training data's breadth (dataset v2); each is tunable end to end too.
        Network("densenet121", _vision("densenet121"), "torchvision DenseNet-121, 1x3x224x224"),
        Network("inception_v3", _vision("inception_v3", size=299, aux_logits=False, init_weights=False),
                "torchvision Inception-v3, 1x3x299x299"),
        Network("squeezenet1_1", _vision("squeezenet1_1"), "torchvision SqueezeNet 1.1, 1x3x224x224"),
        Network("squeezenet1_1-b4", _vision("squeezenet1_1", batch=4), "torchvision SqueezeNet 1.1, 4x3x224x224"),
        Network("shufflenet_v2_x1_0", _vision("shufflenet_v2_x1_0"), "torchvision ShuffleNetV2 x1.0, 1x3x224x224"),
        Network("mnasnet1_0", _vision("mnasnet1_0"), "torchvision MNASNet 1.0, 1x3x224x224"),
        Network("resnext50_32x4d", _vision("resnext50_32x4d"), "torchvision ResNeXt-50 32x4d, 1x3x224x224"),
        Network("wide_resnet50_2", _vision("wide_resnet50_2"), "torchvision Wide ResNet-50-2, 1x3x224x224"),
        Network("vgg11", _vision("vgg11"), "torchvision VGG-11, 1x3x224x224"),
        Network("resnet18-b4", _vision("resnet18", batch=4), "torchvision ResNet-18, 4x3x224x224"),
        Network("distilbert", _transformer("DistilBertConfig", "DistilBertModel"),
                f"DistilBERT encoder (random init), sequence {SEQ_LEN}"),
        Network("distilbert-s256", _transformer("DistilBertConfig", "DistilBertModel", seq_len=256),
                "DistilBERT encoder (random init), sequence 256"),
        Network("opt-125m", _transformer("OPTConfig", "OPTModel"), f"OPT-125m decoder (random init), sequence {SEQ_LEN}"),
        Network("t5-small-encoder", _transformer("T5Config", "T5EncoderModel"),
                f"T5-small encoder (random init), sequence {SEQ_LEN}"),
    ]
}


def get_network(name: str) -> Network:
    if name not in NETWORKS:
        raise CwmError(f"unknown network {name!r}; known: {', '.join(NETWORKS)}")
    return NETWORKS[name]


def torch_model(name: str):
    """The PyTorch model and example inputs of a network."""
    return get_network(name).build()


def relax_module(name: str, target, *, bind_params: bool = True):
    """Export a named network to Relax (see ``relax_from_torch``)."""
    model, inputs = torch_model(name)
    return relax_from_torch(model, inputs, target, bind_params=bind_params)


def _tidy(task_name: str) -> str:
    """Readable task name: drop the numeric suffixes Relax adds to fused op names."""
    return re.sub(r"(?<=[a-z_])\d+(?=_|$)", "", task_name)


@lru_cache(maxsize=8)
def _network_tasks_cached(name: str, target_json: str) -> tuple[Task, ...]:
    import json

    from tvm.target import Target

    target = Target(json.loads(target_json))
    return tuple(extract_tasks(relax_module(name, target), target, network=name))


def network_tasks(name: str, target=None) -> list[Task]:
    """The MetaSchedule tasks of a network, with their weights (occurrence counts)."""
    get_network(name)
    target = target or make_target()
    return list(_network_tasks_cached(name, str(target)))


def tunable(task: Task) -> bool:
    """Tasks that get the main budget: the ones that compute. The others are layout moves (reshape,
    transpose, small elementwise epilogues); they get ``LAYOUT_TRIALS_PER_TASK`` each
    (``cwm.tuning.tuner.tune_layout_tasks``), because untuned they run as serial scalar loops."""
    return task.kind != "elementwise" or task.flops > 1e6


# Enough for a layout move's small design space to be parallel and vectorized.
LAYOUT_TRIALS_PER_TASK = 8
