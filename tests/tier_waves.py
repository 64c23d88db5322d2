"""An engine's workload of prefix-sharing waves that pushes a shared prompt's KV out of a small
device pool into the host and disk tiers and brings it back (tests/test_kv_tiers.py, and the same
on CUDA in tests/test_cuda.py)."""

from __future__ import annotations

from conftest import run_to_completion, tiny_config, tiny_model, tiny_state_dict

from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
from kvflow.kv.cache import KVLayout
from kvflow.kv.tiers import DISK_SLOT_OVERHEAD
from kvflow.model.llama import LlamaModel

TBS = 4
SYS = list(range(10, 30))
OTHER = list(range(60, 84))
WAVES = [
    [SYS + [40, 41, 42], SYS + [70, 71, 72, 73]],
    [OTHER, [o + 1 for o in OTHER], [o + 2 for o in OTHER]],  # SYS leaves the device pool
    [[o + 3 for o in OTHER], [o + 4 for o in OTHER]],  # ... and, with a small host tier, the host tier
    [SYS + [55], SYS + [56, 57], SYS + [40, 41, 42]],  # SYS comes back from host or disk
]


def wave_params(i: int):
    from kvflow.sched.sampling import SamplingParams

    if i % 3 == 1:
        return SamplingParams(max_tokens=5, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=4 + i % 3, temperature=0, ignore_eos=True)


def engine_waves(on: bool = True, host_blocks: int = 0, disk_blocks: int = 0, disk_path=None, damage=None,
                 device: str = "cpu"):
    cfg = tiny_config()
    bpb = KVLayout.for_model(cfg, 1, TBS).bytes_per_block
    ec = EngineConfig(block_size=TBS, num_kv_blocks=24, enable_prefix_caching=on, host_kv_bytes=host_blocks * bpb,
                      disk_kv_bytes=disk_blocks * (bpb + DISK_SLOT_OVERHEAD), disk_kv_path=disk_path, device=device)
    model = tiny_model(cfg) if device == "cpu" else LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), device=device)
    eng = LLMEngine(model, None, ec)
    outs, i = [], 0
    for w, wave in enumerate(WAVES):
        if damage is not None and w == len(WAVES) - 1:
            damage(eng)
        reqs = []
        for p in wave:
            reqs.append(eng.add_request(p, wave_params(i)))
            i += 1
        final = run_to_completion(eng)
        outs += [final[r.request_id].token_ids for r in reqs]
        check_all_engine(eng)
    return outs, eng


def check_all_engine(eng: LLMEngine) -> None:
    kv = eng.kv_manager
    kv.pool.check()
    for t in (kv.host, kv.disk):
        if t is not None:
            t.check()
