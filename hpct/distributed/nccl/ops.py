"""The op bodies of the NCCL engine: each turns torch arguments into NCCL calls.

Every op is built whole before it is handed to the engine (``_submit``): the NCCL calls with
every argument computed (data type and reduce-op codes, pointers, counts), the tensors the GPU
may touch, and the copies out of staging buffers that must follow the calls on the engine
stream.  So an argument NCCL cannot take raises here, at the call, before anything is queued
or launched, and a non-contiguous output is copied back by the launch itself.  Arguments are
checked as ProcessGroupNCCL checks them by the group facade (group.py, checks.py) first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import HpctArgumentError
from . import library as nccl_lib


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.dtype.is_complex else t


def _copies(pairs):
    """A post step: copy each staging buffer into the caller's tensor (on the engine stream)."""
    pairs = [(dst, src) for dst, src in pairs if dst is not src]
    if not pairs:
        return None

    def post():
        for dst, src in pairs:
            dst.copy_(src.reshape(dst.shape))
    return post


FP8_MIN_SM = 90          # NCCL refuses float8 reductions below sm_90 (enqueue.cc, "FP8 reduction")


def code_of_float8(dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


class NcclOps:
    """Mixed into NcclEngine, which provides _submit, rank, size, runtime and the codes."""

    def _capability(self, t: torch.Tensor) -> int:
        """The device's compute capability as 90 for sm_90, asked once."""
        cap = self._codes.get("sm")
        if cap is None:
            major, minor = self.runtime.capability(t.device)
            cap = self._codes["sm"] = major * 10 + minor
        return cap

    # ---- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors, op=dist.ReduceOp.SUM):
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, op)
        t = tensors[0]
        dtype, last = t.dtype, self._last_codes
        # The last (op, dtype) and their codes, compared by identity: hashing a ReduceOp costs
        # 0.2 us, and a training loop reduces one dtype with one op.
        if last[0] is op and last[1] is dtype and self._fns and t.is_contiguous():   # DDP's buckets
            p = t.data_ptr()
            return self._submit_one("allreduce", tensors, [self._fns["all_reduce"] + (p, p, t.numel(), last[2], last[3])])
        codes = self._codes
        dt = codes.get(dtype)                     # known only for real dtypes (never complex)
        if dt is not None and self._fns and t.is_contiguous():      # staging not needed
            code = self._op(op, t)
            self._last_codes = (op, dtype, dt, code)
            p = t.data_ptr()
            return self._submit_one("allreduce", tensors, [self._fns["all_reduce"] + (p, p, t.numel(), dt, code)])
        return self._reduce_all("allreduce", tensors, op)

    def allreduce_coalesced(self, tensors, op=dist.ReduceOp.SUM):
        return self._reduce_all("allreduce_coalesced", tensors, op)

    def _reduce_all(self, what, tensors, op):
        self._begin(what, tensors)
        bufs = [_contig(t) for t in tensors]
        calls = []
        for b in bufs:
            v = _real(b)
            calls.append(self._fns["all_reduce"] + (v.data_ptr(), v.data_ptr(), v.numel(), self._dt(v), self._op(op, b)))
        return self._submit(what, tensors, calls, tensors, keep=bufs, post=_copies(zip(tensors, bufs)))

    def broadcast(self, tensors, root: int, root_tensor: int = 0):
        t = tensors[root_tensor]
        self._begin("broadcast", [t])
        b = _contig(t)
        v = _real(b)
        calls = [self._fns["broadcast"] + (v.data_ptr(), v.data_ptr(), v.numel(), self._dt(v), root)]
        return self._submit("broadcast", [t], calls, tensors, keep=[b], post=_copies([(t, b)]),
                            peer=root if root != self.rank else None)

    def reduce(self, tensor, root: int, op=dist.ReduceOp.SUM):
        self._begin("reduce", [tensor])
        b = _contig(tensor)
        v = _real(b)
        calls = [self._fns["reduce"] + (v.data_ptr(), v.data_ptr(), v.numel(), self._dt(v), self._op(op, b), root)]
        return self._submit("reduce", [tensor], calls, [tensor], keep=[b], post=_copies([(tensor, b)]))

    def all_gather_single(self, output, input):
        return self._gathers("all_gather_into_tensor", [output], [input])

    def all_gather_single_coalesced(self, outputs, inputs):
        return self._gathers("all_gather_into_tensor_coalesced", outputs, inputs)

    def _gathers(self, what, outputs, inputs, result=None, post_pairs=()):
        self._begin(what, [*outputs, *inputs])
        outs, ins = [_contig(o) for o in outputs], [_contig(i) for i in inputs]
        calls = []
        for o, i in zip(outs, ins):
            o, i = _real(o), _real(i)
            calls.append(self._fns["all_gather"] + (i.data_ptr(), o.data_ptr(), i.numel(), self._dt(i)))
        return self._submit(what, [*outputs, *inputs], calls, outputs if result is None else result,
                            keep=outs + ins, post=_copies([*zip(outputs, outs), *post_pairs]))

    def allgather(self, output_lists, inputs):
        inp = inputs[0]
        flat = torch.empty((self.size,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
        pairs = [(dst, flat[r]) for outs in output_lists for r, dst in enumerate(outs)]
        result = output_lists[0] if len(output_lists) == 1 else output_lists
        return self._gathers("all_gather", [flat], [inp], result=result, post_pairs=pairs)

    def allgather_coalesced(self, output_lists, input_list):
        # output_lists[rank][i] receives rank's input i
        flats = [torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device) for t in input_list]
        pairs = [(output_lists[r][i], flats[i][r]) for r in range(self.size) for i in range(len(input_list))]
        return self._gathers("allgather_coalesced", flats, input_list, result=output_lists, post_pairs=pairs)

    def reduce_scatter_single(self, output, input, op=dist.ReduceOp.SUM):
        return self._scatters("reduce_scatter_tensor", [output], [input], op)

    def reduce_scatter_single_coalesced(self, outputs, inputs, op=dist.ReduceOp.SUM):
        return self._scatters("reduce_scatter_tensor_coalesced", outputs, inputs, op)

    def _scatters(self, what, outputs, inputs, op, pre=None, keep=()):
        self._begin(what, [*outputs, *inputs])
        outs, ins = [_contig(o) for o in outputs], [_contig(i) for i in inputs]
        calls = []
        for o, i, t in zip(outs, ins, outputs):
            o, i = _real(o), _real(i)
            calls.append(self._fns["reduce_scatter"] + (i.data_ptr(), o.data_ptr(), o.numel(), self._dt(o), self._op(op, t)))
        return self._submit(what, [*outputs, *inputs], calls, outputs, keep=[*outs, *ins, *keep],
                            post=_copies(zip(outputs, outs)), pre=pre)

    def reduce_scatter(self, out, ins, op=dist.ReduceOp.SUM):
        flat = torch.empty((len(ins),) + tuple(out.shape), dtype=out.dtype, device=out.device)

        def stack():            # on the engine stream, once it has followed the caller's
            for r, t in enumerate(ins):
                flat[r].copy_(t.reshape(out.shape))
        return self._scatters("reduce_scatter", [out], [flat], op, pre=stack, keep=ins)

    def all_to_all_single(self, output, input, out_splits, in_splits):
        self._begin("all_to_all_single", [output, input])
        out, inp = _contig(output), _contig(input)
        o, i = _real(out).reshape(-1), _real(inp).reshape(-1)
        dt = self._dt(i)
        esz = i.element_size() * (2 if input.is_complex() else 1)
        per_elem = 2 if input.is_complex() else 1
        calls = []
        for peer, ((so, sc), (ro, rc)) in enumerate(zip(self._parts(input, in_splits),
                                                        self._parts(output, out_splits))):
            calls.append(self._fns["send"] + (i.data_ptr() + so * esz, sc * per_elem, dt, peer))
            calls.append(self._fns["recv"] + (o.data_ptr() + ro * esz, rc * per_elem, dt, peer))
        return self._submit("all_to_all_single", [output, input], calls, [output], keep=[out, inp],
                            post=_copies([(output, out)]))

    def _parts(self, t, splits):
        """(element offset, element count) of each peer's part of t along dim 0."""
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        sizes = list(splits) if splits else [rows // self.size] * self.size
        parts, acc = [], 0
        for k in sizes:
            parts.append((acc * per_row, k * per_row))
            acc += k
        return parts

    def alltoall(self, outs, ins):
        sends = [(p, t) for p, t in enumerate(ins)]
        recvs = [(p, t) for p, t in enumerate(outs)]
        return self._exchange("all_to_all", sends, recvs, outs)

    def gather(self, outs, inp, root: int):
        recvs = list(enumerate(outs)) if self.rank == root else []
        return self._exchange("gather", [(root, inp)], recvs, [outs] if outs is not None else [])

    def scatter(self, out, ins, root: int):
        sends = list(enumerate(ins)) if self.rank == root else []
        return self._exchange("scatter", sends, [(root, out)], [out])

    def _exchange(self, what, sends, recvs, result, *, defer=False, peer=None):
        """Sends and receives as one NCCL group: [(peer, tensor)] each way."""
        self._begin(what, [t for _, t in [*sends, *recvs]])
        for p, _ in [*sends, *recvs]:
            if not 0 <= p < self.size:
                raise self._refuse(HpctArgumentError(
                    f"hpct NCCL {what}: peer rank {p} is outside the group of {self.size}",
                    fix=f"pass a group rank from 0 to {self.size - 1}"))
        calls, keep, back = [], [], []
        for method, pairs in (("send", sends), ("recv", recvs)):
            for p, t in pairs:
                b = _contig(t)
                v = _real(b)
                calls.append(self._fns[method] + (v.data_ptr(), v.numel(), self._dt(v), p))
                keep.append(b)
                if method == "recv":
                    back.append((t, b))
        tensors = [t for _, t in [*sends, *recvs]]
        return self._submit(what, tensors, calls, result, keep=keep, post=_copies(back), defer=defer, peer=peer)

    def barrier(self):
        dev = self._device if self._device is not None else (
            self.runtime.default_device() if self.runtime.available() else None)
        if dev is None:
            self._check_device([], "barrier")
        t = torch.zeros(1, device=dev)
        self._begin("barrier", [t])
        calls = [self._fns["all_reduce"] + (t.data_ptr(), t.data_ptr(), 1, self._dt(t), nccl_lib.NCCL_SUM)]
        return self._submit("barrier", [t], calls, [], host_wait=True)

    # ---- point to point ---------------------------------------------------------------------
    # Deferred: consecutive sends and receives go to NCCL as one group when the application
    # next needs them (a wait, get_future, is_completed, the next op, end_coalescing, shutdown).
    # No helper thread launches them: a send that nobody waits for goes out with the next op.
    def send(self, tensors, dst: int, tag: int = 0):
        return self._exchange(f"send to rank {dst}", [(dst, t) for t in tensors], [], list(tensors),
                              defer=True, peer=dst)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._exchange(f"recv from rank {src}", [], [(src, t) for t in tensors], list(tensors),
                              defer=True, peer=src)

    # ---- codes, computed before anything is queued -------------------------------------------
    def _begin(self, what: str, tensors) -> None:
        """Before an op's codes are computed: its tensors' device is checked and the library is
        opened at the group's first op (a process that never runs one opens none)."""
        if self._lib is None:
            self._check_device(tensors, what)
            self._lib = self._load()
        if not self._fns:
            self._bind_native()

    def _dt(self, t: torch.Tensor) -> int:
        # Codes are computed once per dtype (and op): building them cost a small op ~20 us.
        code = self._codes.get(t.dtype)
        if code is None:
            try:
                code = self._codes[t.dtype] = nccl_lib.nccl_dtype(t.dtype, self._lib.version)
            except HpctArgumentError as err:
                raise self._refuse(err) from None
        return code

    def _op(self, op, t: torch.Tensor) -> int:
        kind = getattr(op, "op", op)
        try:
            key = (kind, t.dtype)
            code = self._codes.get(key)
        except TypeError:                 # an unhashable op object: no cache
            key, code = None, None
        if code is not None:
            return code
        try:
            if code_of_float8(t.dtype) and self._capability(t) < FP8_MIN_SM:
                cap = self._capability(t)
                raise HpctArgumentError(f"hpct NCCL: a reduction of {t.dtype} needs an sm_90 GPU or newer (this one "
                                        f"is sm_{cap // 10}{cap % 10}); NCCL refuses it below sm_90",
                                        fix="reduce in bfloat16 or float16 (cast first), or gather float8 "
                                            "tensors instead")
            if t.dtype.is_complex and kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                raise HpctArgumentError(f"hpct NCCL: ReduceOp {op} is not defined for complex tensors",
                                        fix="reduce complex tensors with SUM or AVG")
            code = nccl_lib.nccl_op(op, t.dtype)
        except HpctArgumentError as err:
            raise self._refuse(err) from None
        if key is not None:
            self._codes[key] = code
        return code
