"""Stacked convolutions, forward and backward, by four routes: which one a GPU runs fastest.

Every route computes, for C clients with B samples each, the convolution of each client's samples
with that client's own weight, and the gradients of input and weight. Timed with CUDA events (or
wall-clock on a CPU), medians of ``--repeats``; each route is compared with a per-client
``F.conv2d`` reference computed here, and checked for batch invariance: client 0's bits must not
change when its neighbours in the call do.

    python benchmarks/conv_modes.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_aten = torch.ops.aten

# (name, c_in, c_out, size, kernel, padding): the FedAvg CNN's two convolutions on CIFAR shapes and
# two of ResNetGN-20's 3x3 convolutions.
SHAPES = [
    ("fedavg-conv1", 3, 32, 32, 5, 2),
    ("fedavg-conv2", 32, 64, 16, 5, 2),
    ("resnet-3x3-16", 16, 16, 32, 3, 1),
    ("resnet-3x3-64", 64, 64, 8, 3, 1),
]


def grouped(
    x: Tensor, w: Tensor, g: Tensor, k: int, p: int, channels_last: bool = False
) -> tuple[Tensor, ...]:
    """One cuDNN convolution with the clients as groups; x [C, B, Cin, H, W], w [C, Cout, Cin, k, k]."""
    c, b = x.shape[:2]
    xg = x.transpose(0, 1).reshape(b, -1, *x.shape[3:])
    wg = w.reshape(-1, *w.shape[2:])
    if channels_last:
        xg = xg.contiguous(memory_format=torch.channels_last)
        wg = wg.contiguous(memory_format=torch.channels_last)
    y = F.conv2d(xg, wg, None, 1, p, 1, c)
    gg = g.transpose(0, 1).reshape(b, -1, *g.shape[3:])
    if channels_last:
        gg = gg.contiguous(memory_format=torch.channels_last)
    gi, gw, _ = _aten.convolution_backward(
        gg, xg, wg, None, [1, 1], [p, p], [1, 1], False, [0, 0], c, [True, True, False]
    )
    y = y.reshape(b, c, -1, *y.shape[2:]).transpose(0, 1)
    gi = gi.reshape(b, c, *x.shape[2:]).transpose(0, 1)
    return y, gi, gw.reshape(w.shape)


def unfold(x: Tensor, w: Tensor, g: Tensor, k: int, p: int) -> tuple[Tensor, ...]:
    """im2col and batched matmul: one GEMM per client in one cuBLAS call; col2im for the input grad."""
    c, b, cin, h, wd = x.shape
    cout = w.shape[1]
    cols = F.unfold(x.reshape(c * b, cin, h, wd), k, padding=p)  # [C*B, Cin*k*k, L]
    kk, L = cols.shape[1:]
    cols = cols.reshape(c, b, kk, L).permute(0, 2, 1, 3).reshape(c, kk, b * L)  # [C, K, B*L]
    wm = w.reshape(c, cout, kk)
    y = torch.bmm(wm, cols)  # [C, Cout, B*L]
    gm = g.reshape(c, b, cout, L).permute(0, 2, 1, 3).reshape(c, cout, b * L)
    gw = torch.bmm(gm, cols.transpose(1, 2))  # [C, Cout, K]
    gcols = torch.bmm(wm.transpose(1, 2), gm)  # [C, K, B*L]
    gcols = gcols.reshape(c, kk, b, L).permute(0, 2, 1, 3).reshape(c * b, kk, L)
    gi = F.fold(gcols, (h, wd), k, padding=p)
    y = y.reshape(c, cout, b, h, wd).transpose(1, 2)
    return y, gi.reshape(x.shape), gw.reshape(w.shape)


def per_client(x: Tensor, w: Tensor, g: Tensor, k: int, p: int) -> tuple[Tensor, ...]:
    """The reference: one ordinary convolution per client."""
    ys, gis, gws = [], [], []
    for i in range(x.shape[0]):
        ys.append(F.conv2d(x[i], w[i], None, 1, p))
        gi, gw, _ = _aten.convolution_backward(
            g[i], x[i], w[i], None, [1, 1], [p, p], [1, 1], False, [0, 0], 1, [True, True, False]
        )
        gis.append(gi)
        gws.append(gw)
    return torch.stack(ys), torch.stack(gis), torch.stack(gws)


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--tf32", choices=["off", "on", "both"], default="off", help="CUDA: TF32 in cuDNN and cuBLAS"
    )
    ap.add_argument(
        "--api",
        choices=["legacy", "new"],
        default="legacy",
        help="set TF32 with allow_tf32 (what the engine does) or with the per-operator fp32_precision",
    )
    ap.add_argument("--shapes", nargs="*", choices=[s[0] for s in SHAPES], help="restrict to these")
    args = ap.parse_args()
    dev, c, b = args.device, args.clients, args.batch
    cuda = dev.startswith("cuda")
    if cuda:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        print(
            "device",
            torch.cuda.get_device_name(),
            "torch",
            torch.__version__,
            "cudnn deterministic, api",
            args.api,
        )
    print(
        f"C={c} clients x B={b} samples, fp32, forward + input grad + weight grad, median of {args.repeats}"
    )
    print("rel err: max|fp32 - fp64 per-client reference| / max|reference| over the three outputs")
    print(f"{'shape':<15} {'tf32':<5} {'route':<16} {'ms':>8} {'GFLOP/s':>9} {'rel err':>9} {'invariant':>9}")
    routes: dict[str, Callable[..., tuple[Tensor, ...]]] = {
        "per_client": per_client,
        "grouped": grouped,
        "grouped_chlast": lambda *a: grouped(*a, channels_last=True),
        "unfold_bmm": unfold,
    }
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.tf32] if cuda else [False]
    for name, cin, cout, size, k, p in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(c, b, cin, size, size, generator=gen).to(dev)
        w = (torch.randn(c, cout, cin, k, k, generator=gen) * 0.1).to(dev)
        g = torch.randn(c, b, cout, size, size, generator=gen).to(dev)
        flop = 3 * 2 * c * b * size * size * cout * cin * k * k
        ref = per_client(x.double(), w.double(), g.double(), k, p)
        x2, w2, g2 = x.clone(), w.clone(), g.clone()
        for t in (x2, w2, g2):
            t[1:].normal_()
        for tf32 in settings:
            if args.api == "legacy":
                torch.backends.cudnn.allow_tf32 = tf32
                torch.backends.cuda.matmul.allow_tf32 = tf32
            else:
                torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"
                torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
            for route, fn in routes.items():
                args_ = (x, w, g, k, p)
                t = timed(lambda fn=fn, a=args_: fn(*a), dev, args.repeats)
                got = fn(*args_)
                err = max(float((a.double() - r).abs().max() / r.abs().max()) for a, r in zip(got, ref))
                other = fn(x2, w2, g2, k, p)
                inv = all(torch.equal(a[0], o[0]) for a, o in zip(got, other))
                print(
                    f"{name:<15} {'on' if tf32 else 'off':<5} {route:<16} {t * 1e3:>8.2f} "
                    f"{flop / t / 1e9:>9.0f} {err:>9.1e} {inv!s:>9}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
