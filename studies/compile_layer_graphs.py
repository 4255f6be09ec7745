"""How many graphs dynamo compiles when ddlx compiles a model layer by layer (fsdp, PyTorch's
pipeline schedules), against dynamo's default limit of graphs per frame: every layer's compiled
forward is one frame to it, so past the limit the remaining layers run eager. Also counted: the
graphs compiled for symbolic (dynamic) shapes, which a frame gets once it meets a second shape.

    python studies/compile_layer_graphs.py [MODEL ...] [--default-limit]

Dynamo's eager backend (its caching, without inductor's compiling): about 20 s on 2 cores. A
training step and validation, each at a batch of 4 and a smaller last batch of 3, at 32 px.
``--default-limit`` leaves dynamo's limit as torch sets it (what ddlx did before raising it).
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["vgg11", "resnet18", "mobilenet_v2"])
    parser.add_argument("--default-limit", action="store_true")
    args = parser.parse_args()

    from torch._dynamo.utils import counters

    from ddlx import compiling
    from ddlx.models import build_model

    compile_ = torch.compile
    graphs = {"symbolic": 0}

    def eager_backend(graph, example_inputs):
        """Dynamo's eager backend, counting the graphs compiled for symbolic (dynamic) shapes."""
        graphs["symbolic"] += any(isinstance(i, torch.SymInt) or
                                  (isinstance(i, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in i.shape))
                                  for i in example_inputs)
        return graph.forward

    torch.compile = lambda fn, mode=None, **kw: compile_(fn, backend=eager_backend, **kw)
    print("| model | layers | graphs compiled | for symbolic shapes | recompile limit |\n|---|---|---|---|---|")
    for name in args.models:
        model = build_model(name, 10, 3, 32, 0.0)
        config = torch._dynamo.config
        before = (config.recompile_limit, config.accumulated_recompile_limit)
        compiling.compile_model(model, compiling.EACH_LAYER)
        if args.default_limit:
            config.recompile_limit, config.accumulated_recompile_limit = 8, 256
        counters.clear()
        graphs["symbolic"] = 0
        for training in (True, False):
            model.train(training)
            for batch in (4, 3):
                with torch.set_grad_enabled(training):
                    out = model(torch.randn(batch, 3, 32, 32))
                if training:
                    out.sum().backward()
        print(f"| {name} | {len(list(model.children()))} | {counters['stats']['unique_graphs']} | {graphs['symbolic']} "
              f"| {config.recompile_limit} |")
        config.recompile_limit, config.accumulated_recompile_limit = before


if __name__ == "__main__":
    main()
