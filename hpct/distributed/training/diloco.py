"""DiLoCo: many local steps, then one outer step on the averaged pseudo-gradient.

Each member trains its own copy of the model with its inner optimizer and talks only every
``sync_every`` (H) steps: the pseudo-gradient ``global - local`` of every parameter is averaged
over the group and an outer Nesterov-SGD step moves the global parameters, which every member
then takes.  Communication per step falls by about H (Douillard et al., "DiLoCo", 2023).

Options, each independent of the others:

- ``fragments=F`` (streaming DiLoCo): the parameters are cut into F fragments whose syncs are
  spread evenly over the H steps, so the link carries 1/F of the model at a time;
- ``overlap=True``: a sync is started in one ``step()`` and finished in the next, so its transfer
  runs while the caller computes the next inner step; the local progress made meanwhile is kept
  on top of the new global parameters;
- ``quantize="fp16"`` or ``"int8"``: the pseudo-gradient travels in 2 or 1 byte(s) per value
  (int8: one fp32 scale per member), with error feedback (what coding dropped is added to that
  fragment's next sync).  A coded sync is a reduce-scatter (all_to_all of coded chunks, each
  owner sums them in fp32 in rank order) followed by an all_gather of the owners' coded means,
  so every member decodes the same bytes; the values never travel widened.

The global parameters and the outer optimizer's momentum are identical on every member after
every sync (the same reduced bytes, the same arithmetic), which parity checks can rely on.  Works on any torch.distributed group (hpct or Gloo).  docs/diloco.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import HpctArgumentError

QUANTIZE = (None, "fp16", "int8")
INT8_MAX = 127.0


@dataclass
class DiLoCoStats:
    syncs: int = 0                 # fragment syncs completed
    payload_bytes: int = 0         # bytes this member handed to collectives (before the algorithm)


class _Fragment:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.global_flat = torch.cat([p.detach().reshape(-1).float() for p in params]).clone()
        self.momentum = torch.zeros_like(self.global_flat)
        self.error = torch.zeros_like(self.global_flat)

    def local_flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def set_local(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p).to(p.dtype))
                offset += n


class DiLoCo:
    """Wrap an inner optimizer: call ``step()`` after each ``inner_optimizer.step()``."""

    def __init__(self, model: torch.nn.Module, *, sync_every: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, fragments: int = 1, overlap: bool = False,
                 quantize: str | None = None, group=None):
        params = [p for p in model.parameters() if p.requires_grad]
        if not isinstance(sync_every, int) or sync_every < 1:
            raise HpctArgumentError(f"DiLoCo: sync_every={sync_every!r} is not a positive integer",
                                    fix="pass the number of inner steps between syncs, e.g. sync_every=50")
        if not isinstance(fragments, int) or not 1 <= fragments <= min(sync_every, len(params) or 1):
            raise HpctArgumentError(
                f"DiLoCo: fragments={fragments!r} must be an integer from 1 to min(sync_every, number of "
                f"parameters) = {min(sync_every, len(params) or 1)}",
                fix="use fewer fragments or a larger sync_every")
        if quantize not in QUANTIZE:
            raise HpctArgumentError(f"DiLoCo: quantize={quantize!r} is not one of {QUANTIZE}",
                                    fix="pass quantize=None, 'fp16' or 'int8'")
        if not params:
            raise HpctArgumentError("DiLoCo: the model has no trainable parameters", fix="pass the model you train")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.h, self.lr, self.mu = sync_every, float(outer_lr), float(outer_momentum)
        self.overlap, self.quantize = overlap, quantize
        # Contiguous runs of parameters, about equal in size: fragment f syncs at inner steps
        # t with t % H == offset(f), spread evenly over the period.
        total = sum(p.numel() for p in params)
        acc, groups = 0, [[]]
        for p in params:
            if acc >= total * len(groups) / fragments and len(groups) < fragments and groups[-1]:
                groups.append([])
            groups[-1].append(p)
            acc += p.numel()
        while len(groups) < fragments:           # fewer natural cuts than fragments asked for
            big = max(range(len(groups)), key=lambda i: len(groups[i]))
            groups.insert(big + 1, groups[big][len(groups[big]) // 2:])
            groups[big] = groups[big][:len(groups[big]) // 2]
        self.fragments = [_Fragment(g) for g in groups]
        self.offsets = [(i + 1) * sync_every // fragments - 1 for i in range(fragments)]
        self.t = 0
        self.pending: list = []                  # (fragment, generator, works, local at launch)
        self.stats = DiLoCoStats()

    # ------------------------------------------------------------------ driving
    def step(self) -> int:
        """Count one inner step; run the syncs due now.  Returns the number of syncs finished."""
        done = self._advance()
        for i, off in enumerate(self.offsets):
            if self.t % self.h == off:
                frag = self.fragments[i]
                if any(item[0] is frag for item in self.pending):   # H shorter than the reduction
                    done += self.finish()
                launch = frag.local_flat()
                delta = frag.global_flat - launch
                gen = self._reduce(frag, delta)
                self.pending.append([frag, gen, next(gen), launch])
        self.t += 1
        if not self.overlap:
            done += self.finish()
        return done

    def finish(self) -> int:
        """Complete every sync in flight (before a checkpoint, an evaluation or the end)."""
        done = 0
        while self.pending:
            done += self._advance(block=True)
        return done

    def _advance(self, block: bool = False) -> int:
        done, still = 0, []
        for item in self.pending:
            frag, gen, works, launch = item
            while True:
                for w in works:
                    w.wait()
                try:
                    works = gen.send(None)
                except StopIteration as stop:
                    self._apply(frag, stop.value, launch)
                    done += 1
                    break
                if not block:                    # next phase in flight: finish it next step
                    item[2] = works
                    still.append(item)
                    break
        self.pending = still
        return done

    def _apply(self, frag: _Fragment, avg: torch.Tensor, launch: torch.Tensor) -> None:
        # Outer Nesterov SGD on the global copy (torch.optim.SGD(nesterov=True)'s arithmetic).
        frag.momentum.mul_(self.mu).add_(avg)
        frag.global_flat.sub_(avg.add(frag.momentum, alpha=self.mu), alpha=self.lr)
        progress = frag.local_flat() - launch    # inner steps taken while the sync was in flight
        frag.set_local(frag.global_flat + progress)
        self.stats.syncs += 1

    # ------------------------------------------------------------------ reductions
    def _reduce(self, frag: _Fragment, delta: torch.Tensor):
        """A generator: yields lists of in-flight works, returns the group's mean of ``delta``."""
        if self.quantize is None:
            return self._reduce_fp32(delta)
        return self._reduce_coded(frag, delta)

    def _reduce_fp32(self, delta):
        buf = delta.clone()
        self.stats.payload_bytes += buf.numel() * 4
        yield [dist.all_reduce(buf, group=self.group, async_op=True)]
        return buf / self.world

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wire tensor, scale): int8 with one scale, or fp16's bits as int16 (scale 1)."""
        if self.quantize == "fp16":
            return x.half().view(torch.int16), torch.ones(())
        scale = torch.clamp(x.abs().max(), min=1e-30) / INT8_MAX
        return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale

    def _decode(self, wire: torch.Tensor, scale) -> torch.Tensor:
        if self.quantize == "fp16":
            return wire.view(torch.float16).float()
        return wire.float() * scale

    def _reduce_coded(self, frag, delta):
        # Quantized reduce-scatter (all_to_all of coded chunks; the owner of each chunk sums them
        # in fp32 in rank order), then an all_gather of the owners' coded means: every member
        # decodes the same bytes.  Error feedback keeps what this member's coding dropped.
        n = self.world
        x = delta + frag.error
        pad = (-x.numel()) % n
        xp = torch.cat([x, x.new_zeros(pad)]) if pad else x
        wire, scale = self._encode(xp)
        frag.error = x - self._decode(wire, scale)[:x.numel()]
        chunk = xp.numel() // n
        scales = torch.zeros(n)
        scales[self.rank] = scale
        got = torch.empty_like(wire)
        self.stats.payload_bytes += wire.numel() * wire.element_size() + 4
        yield [dist.all_reduce(scales, group=self.group, async_op=True),       # each rank's scale
               dist.all_to_all_single(got, wire, group=self.group, async_op=True)]
        mine = torch.zeros(chunk)
        for i in range(n):
            mine += self._decode(got[i * chunk:(i + 1) * chunk], scales[i])
        mine /= n
        own, own_scale = self._encode(mine)
        everyone = torch.empty(chunk * n, dtype=own.dtype)
        own_scales = torch.zeros(n)
        own_scales[self.rank] = own_scale
        self.stats.payload_bytes += own.numel() * own.element_size() + 4
        yield [dist.all_gather_into_tensor(everyone, own, group=self.group, async_op=True),
               dist.all_reduce(own_scales, group=self.group, async_op=True)]
        avg = torch.cat([self._decode(everyone[i * chunk:(i + 1) * chunk], own_scales[i]) for i in range(n)])
        return avg[:x.numel()]
