"""The hidden-state ring between two stages on one host: what goes in comes out, slots are reused in
turn, and a descriptor that does not fit the ring is refused."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from kvflow.streaming.hidden_ring import HEADER, HiddenRing, create_ring, open_ring
from kvflow.streaming.transports.shm_segment import create


@pytest.fixture
def ring():
    seg = create_ring(3, 1000)  # (rounded up to 1024 bytes a slot)
    writer, reader = HiddenRing(seg.name), HiddenRing(seg.name)  # two mappings, as two processes have
    yield writer, reader
    writer.close()
    reader.close()
    seg.unlink()
    seg.close()


def test_what_a_stage_puts_the_next_reads_from_the_same_slot(ring):
    writer, reader = ring
    assert (writer.slots, writer.slot_bytes) == (3, 1024)
    sent = []
    for i, (rows, dtype) in enumerate([(4, torch.bfloat16), (2, torch.float32), (8, torch.float16), (1, torch.bfloat16)]):
        t = torch.randn(rows, 16).to(dtype)
        desc = writer.put(t)
        assert desc[0] == i % 3, "slots are taken in turn"
        got = reader.get(desc)
        assert got.dtype == dtype and torch.equal(got, t)
        sent.append(t.numel() * t.element_size())
    assert writer.nbytes == sum(sent)


def test_a_slot_is_rewritten_only_after_every_other_slot(ring):
    writer, reader = ring
    descs = [writer.put(torch.full((4, 8), float(i))) for i in range(3)]
    held = [reader.get(d) for d in descs]  # read in place
    assert [float(h[0, 0]) for h in held] == [0.0, 1.0, 2.0]
    writer.put(torch.full((4, 8), 9.0))  # the fourth send reuses the first slot
    assert [float(h[0, 0]) for h in held] == [9.0, 1.0, 2.0]


def test_what_does_not_fit_a_slot_is_left_to_the_message(ring):
    writer, _ = ring
    assert writer.put(torch.zeros(1, 257)) is None  # 1,028 bytes
    assert writer.put(torch.zeros(4, dtype=torch.int64)) is None  # not a hidden-state dtype
    assert writer.next == 0 and writer.nbytes == 0


@pytest.mark.parametrize("desc", [
    [], [0], [3, "float32", 4], [-1, "float32", 4], [0, "int64", 4], [0, "float32", 257], [0, "float32", 16, 17],
    [0, "float32", -4], [True, "float32", 4], [0, "float32", 4.0], ["0", "float32", 4],
], ids=["empty", "no-dtype", "slot-past-end", "negative-slot", "dtype", "too-big", "too-big-2d", "negative-dim",
        "bool-slot", "float-dim", "str-slot"])
def test_a_descriptor_that_does_not_fit_the_ring_is_refused(ring, desc):
    with pytest.raises(ValueError):
        ring[1].get(desc)


def test_only_a_ring_is_mapped_as_one():
    seg = create(f"kvflow-test-{uuid.uuid4().hex[:12]}", HEADER + 4096)
    try:
        np.frombuffer(seg.buf, dtype=np.int64, count=3)[:] = (1, 4, 1024)  # not the ring's magic
        with pytest.raises(ValueError):
            HiddenRing(seg.name)
        assert open_ring(seg.name, "cpu", "test") is None
        assert open_ring("", "cpu", "test") is None
        assert open_ring(f"kvflow-missing-{uuid.uuid4().hex[:12]}", "cpu", "test") is None  # (another host)
    finally:
        seg.unlink()
        seg.close()


def test_a_ring_needs_slots_and_room():
    with pytest.raises(ValueError):
        create_ring(0, 1024)
    with pytest.raises(ValueError):
        create_ring(2, 0)
