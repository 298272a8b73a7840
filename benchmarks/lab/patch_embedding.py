"""ViT-B/16's patch embedding at batch 256 (fp16, H100): the convolution as cuDNN runs it
(``torch.backends.cudnn.benchmark`` off and on, eagerly and under Inductor) against the linear
over patches that ``passes/conv_as_linear`` writes, with the same weight. Eager timings
(CUDA events, host overhead included: one launch or a few). Writes patch_embedding.json to
$OUT (default /tmp).

    OUT=/some/dir python benchmarks/lab/patch_embedding.py
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import environment, rel_err, time_eager_us, write_lab  # noqa: E402

from sparsecc.models import load  # noqa: E402
from sparsecc.passes.conv_as_linear import grid_of, patches  # noqa: E402


def main():
    torch.manual_seed(0)
    model, x = load("vit-b16", batch=256, seq=1)
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d)).half().cuda()
    x = x.half().cuda()
    kernel = tuple(conv.kernel_size)
    weight = conv.weight.flatten(1)

    def as_linear():
        return grid_of(F.linear(patches(x, kernel), weight, conv.bias), x, kernel)

    def timed(fn):
        return round(time_eager_us(fn, warmup_ms=30, rep_ms=200), 1)

    result = environment("patch_embedding")
    rows = result["rows"]
    with torch.no_grad():
        reference = F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), kernel)
        for benchmark in (False, True):
            torch.backends.cudnn.benchmark = benchmark
            for impl, fn in (("conv", lambda: conv(x)), ("conv-inductor", torch.compile(lambda: conv(x))),
                             ("as-linear", as_linear), ("as-linear-inductor", torch.compile(as_linear))):
                row = {"impl": impl, "cudnn_benchmark": benchmark, "M": x.shape[0], "dtype": "float16",
                       "us": None, "us_eager": timed(fn), "rel_err": rel_err(fn(), reference)}
                rows.append(row)
                print(row, flush=True)
            torch._dynamo.reset()
    torch.backends.cudnn.benchmark = False
    write_lab(result, "patch_embedding")


if __name__ == "__main__":
    main()
