"""The outer loop of semi-synchronous training (DiLoCo): pseudo-gradients, their all-reduce, the outer step.

Contract:
- `OuterState(params, sync)` keeps, for this rank's shard, the global parameters (fp32 copies of the
  parameters as of the last outer step) and the outer momentum, and where the island stands in its
  round: `version` (outer steps applied to the global copy), `steps_in_round`, `tokens_in_round`.
  `pseudo_gradient(fragment)` is global minus local, flattened (DiLoCo's outer gradient);
  `outer_step(avg, fragment)` applies SGD with Nesterov momentum to the global copy (PyTorch's form:
  m <- mu m + g; update g + mu m; without momentum, g) and copies it into the model's parameters. With
  outer_lr 1 and no momentum the new parameters are the islands' weighted mean. `fragment_params(k)`:
  the parameters of fragment k (contiguous runs of parameters of about equal size; fragment
  version mod fragments is synchronised next: Streaming DiLoCo).
- `encode` / `decode`: what crosses the slow links: fp32 as is, bf16, or int8 with one fp32 scale per
  tensor piece (max |x| / 127; INTELLECT-1). `ring_allreduce(pg, flat, compression, segments)` sums
  `flat` over the members of a gloo process group in a ring (reduce-scatter, then all-gather of the
  reduced chunks): each hop sends its partial sum encoded and the receiver adds it in fp32, so every
  link carries 2 (n - 1) / n of the encoded bytes; a reduced chunk is encoded once by its owner and
  every member, the owner included, decodes those same bytes, so the result is identical everywhere.
- Pure torch and one process group handed in: no store, no membership (runtime/islands.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sailor_core.semisync import OuterSync

Segments = list[tuple[int, int]]  # (start, end) of each tensor in a flat buffer


def fragments_of(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of the parameters in each fragment: contiguous runs cut where the running total of
    elements passes k / fragments of the whole (a fragment may be empty when one tensor is huge)."""
    total = sum(sizes) or 1
    out: list[list[int]] = [[] for _ in range(fragments)]
    run = 0
    for i, n in enumerate(sizes):
        k = min(fragments - 1, int(run * fragments / total))
        out[k].append(i)
        run += n
    return out


class OuterState:
    """This rank's global copy, outer momentum and round position (see the module's contract)."""

    def __init__(self, params: Sequence[torch.Tensor], sync: OuterSync) -> None:
        self.params = list(params)
        self.sync = sync
        with torch.no_grad():
            self.global_params = [p.detach().to(torch.float32, copy=True) for p in self.params]
            self.momentum = [torch.zeros_like(g) for g in self.global_params] if sync.momentum > 0 else []
        self.fragments = fragments_of([p.numel() for p in self.params], sync.fragments)
        self.version = 0
        self.steps_in_round = 0
        self.tokens_in_round = 0.0

    def fragment_params(self, k: int | None) -> list[int]:
        """The parameters of fragment k (None: all of them)."""
        return list(range(len(self.params))) if k is None else self.fragments[k % len(self.fragments)]

    def segments(self, fragment: int) -> Segments:
        out, at = [], 0
        for i in self.fragment_params(fragment):
            n = self.params[i].numel()
            out.append((at, at + n))
            at += n
        return out

    def pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """global - local of the fragment's parameters, flattened (fp32)."""
        idx = self.fragment_params(fragment)
        if not idx:
            return torch.zeros(0)
        with torch.no_grad():
            return torch.cat([(self.global_params[i] - self.params[i].detach().float()).reshape(-1) for i in idx])

    def outer_step(self, avg: torch.Tensor, fragment: int) -> None:
        """One outer SGD step with the averaged pseudo-gradient `avg`; the parameters become the global copy."""
        mu, lr = self.sync.momentum, self.sync.outer_lr
        at = 0
        with torch.no_grad():
            for i in self.fragment_params(fragment):
                g_i = self.global_params[i]
                d = avg[at:at + g_i.numel()].view_as(g_i)
                at += g_i.numel()
                if mu > 0:
                    m = self.momentum[i]
                    m.mul_(mu).add_(d)
                    g_i.sub_(d + mu * m, alpha=lr)
                else:
                    g_i.sub_(d, alpha=lr)
                self.params[i].copy_(g_i)

    def flat_state(self, fragment: int | None) -> torch.Tensor:
        """The fragment's global copy and momentum, flattened: what a stale island or a replica is sent."""
        idx = self.fragment_params(fragment)
        parts = [self.global_params[i].reshape(-1) for i in idx]
        parts += [self.momentum[i].reshape(-1) for i in idx] if self.momentum else []
        return torch.cat(parts) if parts else torch.zeros(0)

    def set_flat_state(self, flat: torch.Tensor, fragment: int | None, *, to_params: bool) -> None:
        """The inverse of `flat_state`; `to_params`: the parameters become the global copy too."""
        idx = self.fragment_params(fragment)
        at = 0
        with torch.no_grad():
            for bank in [self.global_params] + ([self.momentum] if self.momentum else []):
                for i in idx:
                    n = bank[i].numel()
                    bank[i].copy_(flat[at:at + n].view_as(bank[i]))
                    at += n
            if to_params:
                for i in idx:
                    self.params[i].copy_(self.global_params[i])

    def round_meta(self) -> dict[str, float]:
        return {"version": self.version, "steps_in_round": self.steps_in_round,
                "tokens_in_round": self.tokens_in_round}

    def set_round(self, meta: dict[str, float]) -> None:
        self.version = int(meta["version"])
        self.steps_in_round = int(meta["steps_in_round"])
        self.tokens_in_round = float(meta["tokens_in_round"])


# -- what crosses the slow links ---------------------------------------------------------------------

def encoded_bytes(segments: Segments, compression: str) -> int:
    n = sum(b - a for a, b in segments)
    if compression == "none":
        return 4 * n
    if compression == "bf16":
        return 2 * n
    return n + 4 * len(segments)


def encode(x: torch.Tensor, segments: Segments, compression: str) -> torch.Tensor:
    """`x` (fp32, flat) as the bytes that cross the link (uint8)."""
    x = x.contiguous()
    if compression == "none":
        return x.view(torch.uint8)
    if compression == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    scales = torch.stack([x[a:b].abs().max() / 127.0 if b > a else torch.zeros(()) for a, b in segments]) \
        if segments else torch.zeros(0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    per_elem = torch.repeat_interleave(scales, torch.tensor([b - a for a, b in segments], dtype=torch.long))
    q = torch.clamp(torch.round(x / per_elem), -127, 127).to(torch.int8)
    return torch.cat([scales.to(torch.float32).view(torch.uint8), q.view(torch.uint8)])


def decode(payload: torch.Tensor, segments: Segments, compression: str) -> torch.Tensor:
    """The fp32 values `encode` put in `payload`."""
    if compression == "none":
        return payload.view(torch.float32).clone()
    if compression == "bf16":
        return payload.view(torch.bfloat16).to(torch.float32)
    k = len(segments)
    scales = payload[:4 * k].clone().view(torch.float32)
    per_elem = torch.repeat_interleave(scales, torch.tensor([b - a for a, b in segments], dtype=torch.long))
    return payload[4 * k:].clone().view(torch.int8).to(torch.float32) * per_elem


def _chunk_segments(segments: Segments, lo: int, hi: int) -> Segments:
    """The pieces of `segments` inside [lo, hi), relative to lo (one scale each under int8)."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in segments if min(b, hi) > max(a, lo)]


def ring_allreduce(pg: torch.distributed.ProcessGroup | None, flat: torch.Tensor, compression: str,
                   segments: Segments, *, rank: int, size: int, tag: int = 0) -> torch.Tensor:
    """The sum of `flat` over the group's members, identical on every member (see the module's contract).
    With one member (or no group) it is `flat` through the codec, as the others would see it."""
    n = flat.numel()
    bounds = [n * c // size for c in range(size + 1)]
    chunks = [flat[bounds[c]:bounds[c + 1]].clone() for c in range(size)]
    segs = [_chunk_segments(segments, bounds[c], bounds[c + 1]) for c in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):  # reduce-scatter: chunk (rank - s) goes right, (rank - s - 1) comes from the left
        out_c, in_c = (rank - s) % size, (rank - s - 1) % size
        got = _exchange(pg, encode(chunks[out_c], segs[out_c], compression),
                        encoded_bytes(segs[in_c], compression), right, left, tag)
        chunks[in_c] += decode(got, segs[in_c], compression)
    own = (rank + 1) % size
    payloads: dict[int, torch.Tensor] = {own: encode(chunks[own], segs[own], compression)}
    for s in range(size - 1):  # all-gather of the reduced chunks, as encoded once by their owners
        out_c, in_c = (own - s) % size, (own - s - 1) % size
        payloads[in_c] = _exchange(pg, payloads[out_c], encoded_bytes(segs[in_c], compression), right, left, tag)
    return torch.cat([decode(payloads[c], segs[c], compression) for c in range(size)]) if n else flat.clone()


def _exchange(pg: torch.distributed.ProcessGroup | None, send: torch.Tensor, recv_bytes: int, right: int, left: int,
              tag: int) -> torch.Tensor:
    """Send `send` to `right` while receiving `recv_bytes` bytes from `left`."""
    buf = torch.empty(recv_bytes, dtype=torch.uint8)
    assert pg is not None
    works = []
    if recv_bytes:
        works.append(pg.recv([buf], left, tag))
    if send.numel():
        works.append(pg.send([send.contiguous()], right, tag))
    for w in works:
        w.wait()
    return buf
