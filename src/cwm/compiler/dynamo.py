"""``torch.compile(model, backend="cwm", options={...})``: the Dynamo backend, registered through the
``torch_dynamo_backends`` entry point (pyproject.toml).

Each graph Dynamo captures is compiled with ``cwm.compile``: its parameters and buffers are bound as
constants (prepacked, tuned with the graph), its other inputs stay inputs. A graph that cannot be
compiled (an operator TVM's frontend does not convert, dynamic shapes, any other failure) runs in
eager, with one warning line that says why; the backend never raises.
"""

from __future__ import annotations

import logging

from ..errors import first_line

log = logging.getLogger(__name__)

OPTIONS = ("trials", "cost_model", "target", "work_dir", "model_path", "seed", "progress", "timing_runs")


def _is_weight(node, value) -> bool:
    """A placeholder Dynamo made for a parameter or buffer of the module (not a user input)."""
    import torch

    name = str(node.target)
    return isinstance(value, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name


def _bound_module(gm, example_inputs, weights: list[int]):
    """``gm`` as a module of its user inputs only, the weights registered as buffers (constants)."""
    import torch

    class Bound(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm
            self.positions = weights
            for k, i in enumerate(weights):
                self.register_buffer(f"w{k}", example_inputs[i].detach())
            self.n = len(example_inputs)

        def forward(self, *user):
            args, it, bound = [], iter(user), dict(zip(self.positions, range(len(self.positions))))
            for i in range(self.n):
                args.append(getattr(self, f"w{bound[i]}") if i in bound else next(it))
            return self.gm(*args)

    return Bound().eval()


def cwm_backend(gm, example_inputs, options: dict | None = None, **_):
    """The Dynamo backend: a callable that runs ``gm`` tuned and built by ``cwm.compile``, or ``gm``
    itself (eager) with a warning when that fails. ``options``: keyword arguments of ``cwm.compile``
    (``trials``, ``cost_model``, ``target``, ``work_dir``, ...)."""
    import torch

    from ..errors import CwmError
    from .api import compile as cwm_compile

    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    try:
        if unknown:
            raise CwmError(f"unknown option(s) {', '.join(unknown)}; the cwm backend takes {', '.join(OPTIONS)}")
        if not all(isinstance(x, torch.Tensor) for x in example_inputs):
            raise CwmError("the graph has non-tensor inputs (dynamic shapes?); use torch.compile(..., dynamic=False)")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        weights = [i for i, (n, x) in enumerate(zip(placeholders, example_inputs)) if _is_weight(n, x)]
        users = [i for i in range(len(example_inputs)) if i not in set(weights)]
        module = _bound_module(gm, example_inputs, weights)
        compiled = cwm_compile(module, tuple(example_inputs[i] for i in users), **options)
    except Exception as err:  # never crash the user's torch.compile: run the graph in eager
        log.warning("cwm backend: running a graph in eager: %s", first_line(err))
        return gm.forward

    def run(*args):
        return compiled(*(args[i] for i in users))

    return run
