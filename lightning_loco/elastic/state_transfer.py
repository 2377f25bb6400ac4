"""The state-transfer protocol: how a joiner takes a live replica's state, a small header through the
rendezvous store of the membership that admits it, the tensors point to point over that membership's
process group. (When a heal happens, and with whom, is :mod:`~lightning_loco.elastic.healing`'s.)

**Keys.** Every membership has its own prefix on the store of its first participant, and every rank of a
member a part of it (:mod:`~lightning_loco.elastic.keys`): the process group's rendezvous and the healing
header live under it.

**Protocol.** The donor writes a header once, under ``heal/<joiners>`` of that prefix
(:func:`~lightning_loco.elastic.keys.heal_key`):
the state with every tensor replaced by a placeholder, each tensor's dtype, shape and device, and a header
naming the membership (:func:`prepare`). A joiner's ``get`` waits until the key is written; the joiner
checks the header (:func:`decode`: a state for another membership is an error, never loaded), and the last
joiner to take it deletes it (:func:`take`), so the store never holds a model copy. The tensors then
cross the membership's process group (which every member, joiners included, set up before the switch)
as point-to-point messages from the donor's rank to each joiner's (:class:`Outgoing`,
:class:`Incoming`), with tags above every exchange's:

* the tensors' bytes are cut into messages of at most ``CHUNK_BYTES``; a tensor of ``SMALL_BYTES`` or more
  travels on its own (its messages are views of it, sent and received in place: no copy), smaller ones
  are packed together. Both sides derive the same cut from the header (:func:`cut`);
* at most ``IN_FLIGHT`` messages per joiner are posted at once (memory stays bounded), and each wait is
  bounded by the process group's timeout, so a donor that dies or hangs mid-transfer is an error on the
  joiner naming the message and the timeout, never a silent wait;
* the state loaded is bitwise the one exported (dtypes, shapes and values; tensors come back contiguous);
  with the donor's ``verify_heal``, the header also holds the digests of every tensor it exports (two int64
  numbers each: :mod:`~lightning_loco.elastic.heal_digests`), and the joiner checks what it received against
  them before it assembles the state (the store's path too): a tensor corrupted or changed in transit is a
  ``StateMismatchError`` naming it, and nothing is loaded;
* a joiner may name tensors of its own to receive into (:func:`in_place`: where its own state holds a CPU
  tensor of the same path, dtype and shape, such as the outer state it is about to overwrite), which saves
  the first touch of fresh memory, about as costly as the transfer itself on loopback; the others arrive
  in new tensors.

A donor without a process group (its rendezvous failed) puts the whole state in the header instead,
serialised with ``torch.save``, if it fits in one store value (``STORE_VALUE_MAX``: torch's default
``TCPStore`` backend refuses larger ones); a larger state cannot travel, and the header says so, so
that the joiner stops at once with that reason. The functions take the process
group and the store of one rank's membership and the ranks of donor and joiners in it: nothing assumes
one rank per replica.
"""

from __future__ import annotations

import io
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_loco.elastic.heal_digests import check, sign
from lightning_loco.elastic.keys import taken_key

CHUNK_BYTES = 64 * 2**20  # the largest message of a heal
SMALL_BYTES = 2**16  # tensors below this share messages (one message per tensor would cost a latency each)
IN_FLIGHT = 4  # messages posted at once, per joiner
TAG_BASE = 1 << 30  # heal messages' tags: above every exchange tag of the elastic transport
STORE_VALUE_MAX = 8 * 2**20 - 2**16  # the largest store value torch's TCPStore (libuv backend) takes: 8 MiB
_TENSOR = "__lightning_loco_tensor__"  # a tensor's placeholder in the header's skeleton
_DIGESTS = "__lightning_loco_digests__"  # the header's entry of the donor's digests, one pair per tensor


def header(quorum_id: int, first_round: int, joiners: Sequence[str], donor: str) -> dict[str, Any]:
    """What a state says of the membership it was written for."""
    return {"quorum_id": int(quorum_id), "first_round": int(first_round), "joiners": list(joiners), "donor": donor}


def encode(state: dict[str, Any], head: dict[str, Any], signed: Optional[list[tuple[int, int]]] = None) -> bytes:
    """The state and its header as bytes for the store (``torch.save``), with the digests of the tensors it
    travels with (``signed``: see :func:`~.heal_digests.sign`) if given."""
    buffer = io.BytesIO()
    torch.save({**state, "donor": head["donor"], "membership": head,
                **({} if signed is None else {_DIGESTS: signed})}, buffer)
    return buffer.getvalue()


def decode(raw: bytes, expected: dict[str, Any]) -> dict[str, Any]:
    """The state in ``raw`` (tensors and plain values only: ``weights_only``); ``RuntimeError`` if it was
    written for another membership than ``expected``."""
    state = torch.load(io.BytesIO(raw), weights_only=True)
    if state.get("membership") != expected:
        raise RuntimeError(
            f"The state under this membership's key was written for {state.get('membership')}, not for {expected}: "
            "two memberships shared a store key. Nothing was loaded; restart this replica to join again."
        )
    return state


def put(store: Any, key: str, payload: bytes) -> None:
    """The donor's side: writes the header (or the whole state) once."""
    store.set(key, payload)


def take(store: Any, key: str, joiners: int) -> bytes:
    """A joiner's side: waits for the header (the store's timeout bounds the wait), and the last of the
    ``joiners`` to take it deletes it."""
    raw = store.get(key)
    if store.add(taken_key(key), 1) >= joiners:
        store.delete_key(key)
        store.delete_key(taken_key(key))
    return raw


# ---------------------------------------------------------------- the state as a skeleton and its tensors


def split(value: Any, tensors: list[Tensor]) -> Any:
    """``value`` with every tensor replaced by a placeholder naming its index in ``tensors`` (appended)."""
    if isinstance(value, Tensor):
        tensors.append(value)
        return {_TENSOR: len(tensors) - 1}
    if isinstance(value, dict):
        items = [(k, split(v, tensors)) for k, v in value.items()]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if isinstance(value, list):
        return [split(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(split(v, tensors) for v in value)
    return value


def join(value: Any, tensors: Sequence[Tensor]) -> Any:
    """The inverse of :func:`split`: the placeholders replaced by their tensors."""
    if isinstance(value, dict):
        if len(value) == 1 and _TENSOR in value:
            return tensors[value[_TENSOR]]
        items = [(k, join(v, tensors)) for k, v in value.items()]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if isinstance(value, list):
        return [join(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(join(v, tensors) for v in value)
    return value


def in_place(skeleton: Any, own: Any, metas: Sequence[tuple[torch.dtype, tuple[int, ...], str]]) -> dict[int, Tensor]:
    """Where a joiner can receive tensors in place: for each placeholder of ``skeleton`` (the donor's state,
    see :func:`split`) at whose path ``own`` holds a contiguous CPU tensor of the donor's dtype and shape,
    that tensor (detached), by placeholder index. Empty tensors, and tensors that share memory with an earlier
    one, are left out."""
    found: dict[int, Tensor] = {}
    storages: set[int] = set()

    def walk(theirs: Any, mine: Any) -> None:
        if isinstance(theirs, dict) and len(theirs) == 1 and _TENSOR in theirs:
            i = theirs[_TENSOR]
            dtype, shape, device = metas[i]
            if (isinstance(mine, Tensor) and mine.dtype == dtype and tuple(mine.shape) == tuple(shape)
                    and device == "cpu" and mine.device.type == "cpu" and mine.is_contiguous() and mine.numel()
                    and mine.untyped_storage().data_ptr() not in storages):
                storages.add(mine.untyped_storage().data_ptr())
                found[i] = mine.detach()
        elif isinstance(theirs, dict) and isinstance(mine, dict):
            for key, value in theirs.items():
                if key in mine:
                    walk(value, mine[key])
        elif isinstance(theirs, (list, tuple)) and isinstance(mine, (list, tuple)):
            for value, other in zip(theirs, mine):
                walk(value, other)

    walk(skeleton, own)
    return found


def paths(skeleton: Any) -> list[str]:
    """Each placeholder's path in the state (``extra.optimizers.0.state.3.exp_avg``), by index."""
    found: dict[int, str] = {}

    def walk(value: Any, at: tuple[str, ...]) -> None:
        if isinstance(value, dict) and len(value) == 1 and _TENSOR in value:
            found[value[_TENSOR]] = ".".join(at)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*at, str(key)))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, (*at, str(i)))

    walk(skeleton, ())
    return [found[i] for i in sorted(found)]


def cut(sizes: Sequence[int], chunk_bytes: int = CHUNK_BYTES,
        small: int = SMALL_BYTES) -> list[list[tuple[int, int, int]]]:
    """The messages of a heal: each a list of (tensor index, first byte, end byte). A tensor of ``small``
    bytes or more (or of more than ``chunk_bytes``) has messages of its own, of at most ``chunk_bytes``;
    smaller ones are packed together up to ``chunk_bytes``. Empty tensors have none."""
    messages: list[list[tuple[int, int, int]]] = []
    packed: list[tuple[int, int, int]] = []
    packed_bytes, small = 0, max(1, min(small, chunk_bytes))  # a tensor larger than a message is always cut
    for i, n in enumerate(sizes):
        if n >= small:
            messages += [[(i, a, min(n, a + chunk_bytes))] for a in range(0, n, chunk_bytes)]
        elif n:
            if packed and packed_bytes + n > chunk_bytes:
                messages.append(packed)
                packed, packed_bytes = [], 0
            packed.append((i, 0, n))
            packed_bytes += n
    return messages + ([packed] if packed else [])


def _bytes_of(t: Tensor) -> Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _post(what: str, post: Callable[..., Any], *args: Any) -> Any:
    """A send or receive posted; gloo may fail it at once (the peer's connection already closed): an error
    naming the message, as a failed wait's is."""
    try:
        return post(*args)
    except Exception as err:
        raise RuntimeError(f"{what} failed as it was posted: "
                           f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err


def _wait(work: Any, timeout: float, what: str) -> None:
    started = time.perf_counter()
    try:
        work.wait(timedelta(seconds=timeout))
    except Exception as err:  # gloo: a closed connection, or the wait's timeout
        raise RuntimeError(f"{what} failed after {time.perf_counter() - started:.1f} s (each message waits up to "
                           f"{timeout:g} s): {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err


@dataclass
class Outgoing:
    """The donor's side of one heal, built from the state between rounds (:func:`prepare`)."""

    header: bytes  # for the store: the skeleton and the tensors' metadata, or the whole state
    tensors: list[Tensor] = field(default_factory=list)  # byte views of the state's tensors
    messages: list[list[tuple[int, int, int]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """What one joiner receives: the header and every tensor's bytes."""
        return len(self.header) + sum(t.numel() for t in self.tensors)

    def bound(self, timeout: float) -> float:
        """The longest the transfer can take when each message waits up to ``timeout`` seconds."""
        return (len(self.messages) + 1) * timeout

    def _message(self, segments: list[tuple[int, int, int]]) -> Tensor:
        parts = [self.tensors[i][a:b] for i, a, b in segments]
        data = parts[0] if len(parts) == 1 else torch.cat([p.cpu() for p in parts])
        return data.cpu()

    def send(self, pg: Any, store: Any, key: str, dsts: Sequence[int], timeout: float) -> None:
        """Writes the header, then sends every message to each rank in ``dsts`` (``IN_FLIGHT`` at once per
        rank, each wait bounded by ``timeout``); ``RuntimeError`` naming the message and rank if one fails."""
        put(store, key, self.header)
        posted: deque[tuple[Any, str, Tensor]] = deque()
        total = len(self.messages)
        for m, segments in enumerate(self.messages):
            data = self._message(segments)
            for dst in dsts:
                what = f"message {m + 1} of {total} to rank {dst}"
                posted.append((_post(what, pg.send, [data], dst, TAG_BASE + m), what, data))
            while len(posted) > IN_FLIGHT * len(dsts):
                work, what, _ = posted.popleft()
                _wait(work, timeout, what)
        while posted:
            work, what, _ = posted.popleft()
            _wait(work, timeout, what)


def prepare(state: dict[str, Any], head: dict[str, Any], over_group: bool = True,
            chunk_bytes: int = CHUNK_BYTES, verify: bool = False) -> Outgoing:
    """The donor's heal of ``state`` for the membership ``head`` names: its tensors over the process group
    (``over_group``), or, without one, the whole state in the header; ``verify``: the header also holds the
    digests of every tensor, which the joiner checks what it received against (:mod:`.heal_digests`)."""
    tensors: list[Tensor] = []
    skeleton = split(state, tensors)
    if not over_group:
        whole = encode(state, head, sign(tensors) if verify else None)
        if len(whole) <= STORE_VALUE_MAX:
            return Outgoing(whole)
        return Outgoing(encode({"unavailable": (
            f"the donor has no process group for this membership (its rendezvous failed), and its state "
            f"({len(whole) / 1e6:.1f} MB) is more than one store value holds ({STORE_VALUE_MAX / 1e6:.1f} MB); "
            "restart this replica to join the next membership")}, head))
    tensors = [t.detach().contiguous() for t in tensors]
    metas = [(t.dtype, tuple(t.shape), str(t.device)) for t in tensors]
    views = [_bytes_of(t) for t in tensors]
    messages = cut([v.numel() for v in views], chunk_bytes)
    head_bytes = encode({"skeleton": skeleton, "tensors": metas, "chunk_bytes": chunk_bytes}, head,
                        sign(tensors) if verify else None)
    return Outgoing(head_bytes, views, messages)


class Incoming:
    """A joiner's side of one heal, from the header it took (checked against ``expected``: see :func:`decode`).

    ``state`` is the donor's state once :meth:`receive` ran (at once for a state that came whole). Where the
    header holds the donor's digests (``verified``), the tensors received are checked against them before the
    state is assembled (:func:`~.heal_digests.check`, naming ``me``, this replica): a mismatch leaves ``state``
    None."""

    def __init__(self, raw: bytes, expected: dict[str, Any], me: Optional[str] = None) -> None:
        decoded = decode(raw, expected)
        self.me, self.signed = me, decoded.pop(_DIGESTS, None)
        self.verified = self.signed is not None
        self.nbytes = len(raw)
        self.metas: list[tuple[torch.dtype, tuple[int, ...], str]] = []
        self.messages: list[list[tuple[int, int, int]]] = []
        self.state: Optional[dict[str, Any]] = None
        self.skeleton: Any = None  # the donor's state with placeholders (None: the state came whole)
        if "unavailable" in decoded:
            raise RuntimeError(decoded["unavailable"])
        if "tensors" not in decoded:  # the donor had no process group: the state came whole
            if self.signed is not None:
                tensors: list[Tensor] = []
                skeleton = split({k: v for k, v in decoded.items() if k not in ("donor", "membership")}, tensors)
                check(paths(skeleton), tensors, self.signed, decoded["membership"], me)
            self.state = decoded
            return
        self._decoded = decoded
        self.skeleton = decoded["skeleton"]
        self.metas = [(dtype, tuple(shape), device) for dtype, shape, device in decoded["tensors"]]
        sizes = [torch.empty(0, dtype=dtype).element_size() * _numel(shape) for dtype, shape, _ in self.metas]
        self.messages = cut(sizes, decoded["chunk_bytes"])
        self.nbytes += sum(sizes)

    def bound(self, timeout: float) -> float:
        """The longest :meth:`receive` can take when each message waits up to ``timeout`` seconds."""
        return (len(self.messages) + 1) * timeout

    def receive(self, pg: Optional[Any], src: int, timeout: float,
                into: Optional[dict[int, Tensor]] = None) -> dict[str, Any]:
        """Receives the tensors from rank ``src`` of ``pg`` (``IN_FLIGHT`` messages at once, each wait bounded
        by ``timeout``) and returns the state; ``RuntimeError`` naming the message if one fails. ``into``
        (from :func:`in_place`): tensors to receive in place, by placeholder index; a failed transfer may
        leave them partly written."""
        if self.state is not None:
            return self.state
        if pg is None:
            raise RuntimeError("this replica has no process group for the membership (its rendezvous failed), and "
                               "the donor sends its state over it")
        into = into or {}
        tensors = [into[i] if i in into else torch.empty(shape, dtype=dtype)
                   for i, (dtype, shape, _) in enumerate(self.metas)]
        views = [_bytes_of(t) for t in tensors]
        posted: deque[tuple[Any, str, Tensor, list[tuple[int, int, int]]]] = deque()
        total = len(self.messages)

        def land(work: Any, what: str, data: Tensor, segments: list[tuple[int, int, int]]) -> None:
            _wait(work, timeout, what)
            if len(segments) > 1:  # a packed message: its tensors are copied out
                at = 0
                for i, a, b in segments:
                    views[i][a:b].copy_(data[at : at + b - a])
                    at += b - a

        for m, segments in enumerate(self.messages):
            if len(segments) == 1:
                i, a, b = segments[0]
                data = views[i][a:b]  # received in place
            else:
                data = torch.empty(sum(b - a for _, a, b in segments), dtype=torch.uint8)
            what = f"message {m + 1} of {total} from rank {src}"
            posted.append((_post(what, pg.recv, [data], src, TAG_BASE + m), what, data, segments))
            while len(posted) > IN_FLIGHT:
                land(*posted.popleft())
        while posted:
            land(*posted.popleft())
        if self.signed is not None:
            check(paths(self.skeleton), tensors, self.signed, self._decoded["membership"], self.me)
        placed = [t if device == "cpu" else t.to(device) for t, (_, _, device) in zip(tensors, self.metas)]
        decoded = self._decoded
        self.state = {**join(decoded["skeleton"], placed), "donor": decoded["donor"],
                      "membership": decoded["membership"]}
        return self.state


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
