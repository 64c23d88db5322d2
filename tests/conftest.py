"""Shared factories: tiny random-weight Llama models (2-4 layers, hidden 64), optionally saved as a checkpoint dir."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():  # the Triton kernels run on CPU tensors, interpreted (read when a kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

from kvflow.config import EngineConfig  # noqa: E402

from kvflow.engine.engine import LLMEngine
from kvflow.sched.scheduler import SchedulerConfig  # noqa: E402
from kvflow.kv.cache import KVCache, KVLayout  # noqa: E402
from kvflow.model.config import ModelConfig, RopeScaling  # noqa: E402
from kvflow.model.llama import LlamaModel  # noqa: E402

TINY_VOCAB = 96


def tiny_config(num_layers: int = 2, rope_scaling: RopeScaling | None = None, **kw) -> ModelConfig:
    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling or RopeScaling(),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny",
    )
    base.update(kw)
    return ModelConfig(**base)


def tiny_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face Llama names (scaled so activations stay O(1))."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    D, I = cfg.hidden_size, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": rnd(cfg.vocab_size, D, scale=1.0), "model.norm.weight": 1 + rnd(D, scale=0.1)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(cfg.vocab_size, D, scale=0.3)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + rnd(D, scale=0.1)
        sd[p + "post_attention_layernorm.weight"] = 1 + rnd(D, scale=0.1)
        sd[p + "self_attn.q_proj.weight"] = rnd(cfg.q_size, D)
        sd[p + "self_attn.k_proj.weight"] = rnd(cfg.kv_size, D)
        sd[p + "self_attn.v_proj.weight"] = rnd(cfg.kv_size, D)
        sd[p + "self_attn.o_proj.weight"] = rnd(D, cfg.q_size)
        sd[p + "mlp.gate_proj.weight"] = rnd(I, D)
        sd[p + "mlp.up_proj.weight"] = rnd(I, D)
        sd[p + "mlp.down_proj.weight"] = rnd(D, I)
    return sd


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, layer_range=None) -> LlamaModel:
    cfg = cfg or tiny_config()
    return LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg, seed), layer_range=layer_range)


def tiny_cache(cfg: ModelConfig, num_blocks: int = 64, block_size: int = 4, layer_range=None) -> KVCache:
    return KVCache(KVLayout.for_model(cfg, num_blocks, block_size, layer_range))


def tiny_engine(
    cfg: ModelConfig | None = None,
    num_kv_blocks: int = 128,
    block_size: int = 4,
    seed: int = 0,
    tokenizer=None,
    prefix_caching: bool = True,
    **sched,
) -> LLMEngine:
    cfg = cfg or tiny_config()
    config = EngineConfig(
        block_size=block_size, num_kv_blocks=num_kv_blocks, scheduler=SchedulerConfig(**sched) if sched else SchedulerConfig(),
        enable_prefix_caching=prefix_caching,
    )
    return LLMEngine(tiny_model(cfg, seed), tokenizer, config)


def run_to_completion(engine: LLMEngine) -> dict[str, object]:
    final = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 10_000, "engine did not finish"
    return final


def save_tiny_checkpoint(directory: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """A HF-style checkpoint dir: config.json, model.safetensors and a word-level tokenizer ("w0".."wN")."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tiny_state_dict(cfg, seed), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg.to_hf()))
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), cfg.vocab_size):
        vocab[f"w{i}"] = i
    tok = HFTok(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins word-level tokens with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    fast.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} {% else %}"
        "<|assistant|> {{ m['content'] }} </s> {% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(str(directory))
    return directory


RAY_OBJECT_STORE = 80 * 2**20


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster on this machine (`ray.cluster_utils.Cluster`) for every test that needs one, this process
    its driver: the head (no CPUs: nothing is placed there) and two nodes, `node_a` and `node_b`, each offering
    one CPU and its own custom resource. Yields the cluster and {resource name: node id}. Its tests run last, one
    after another (`pytest_collection_modifyitems`), so the cluster starts once and nothing else runs beside it."""
    ray = pytest.importorskip("ray", reason="the Ray tests need ray (pip install 'kvflow[ray]')")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False,
                                                          object_store_memory=RAY_OBJECT_STORE))
    nodes = {r: c.add_node(num_cpus=1, resources={r: 1}, object_store_memory=RAY_OBJECT_STORE) for r in ("node_a", "node_b")}
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        yield c, {r: n.node_id for r, n in nodes.items()}
    finally:
        ray.shutdown()
        c.shutdown()


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))  # (stable: otherwise in order)


@pytest.fixture
def cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), tiny_config(num_layers=2))


@pytest.fixture(scope="session")
def tiny4_ckpt_dir(tmp_path_factory) -> Path:
    """A 4-layer tiny model (pipelines of depth 3 and 4); its engine is `tiny_engine(tiny_config(num_layers=4))`."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny4-ckpt"), tiny_config(num_layers=4))


def controller_state(ctrl) -> str:
    """What a controller holds, for a test that waited too long: its epoch and recoveries, each
    pipeline's batches in flight (with their requests and age), queue and requests, each stage's
    liveness and counters, and the requests not finished."""
    now = time.monotonic()
    lines = [f"epoch {ctrl.epoch}, failure {ctrl.failure!r}, recoveries {ctrl.recovery.recoveries}, "
             f"recovering {ctrl.recovery.recovering!r}, stale results {ctrl.stale_results}, submissions {len(ctrl.submissions)}"]
    for p in ctrl.pipelines:
        flight = {b: ([s.request.request_id for s in out.seqs], round(now - p.sent_at.get(b, now), 1)) for b, out in p.in_flight.items()}
        lines.append(f"{p.name}: in flight {flight}, queue {len(p.queue)}, "
                     f"running {[(r.request_id, r.status.name, r.num_computed_tokens, len(r.output_token_ids)) for r in p.sched.running]}, "
                     f"waiting {[r.request_id for r in p.sched.waiting]}")
    for s in ctrl.stages.values():
        lines.append(f"{s.name}: alive {s.alive}, exit {s.process.poll() if s.process is not None else None}, "
                     f"heartbeat {now - s.last_heartbeat:.1f} s ago, busy {s.busy_s:.2f} s, dropped {s.dropped_messages}")
    lines.append(f"unfinished {[(rid, r.status.name, len(r.output_token_ids)) for rid, r in ctrl.reqs.items() if not r.is_finished]}, "
                 f"streams open {sorted(ctrl.sinks)}")
    return "\n".join(lines)


def on_loop_thread(ctrl, *steps) -> list:
    """Each (condition, action) of `steps`, in turn, runs once on the controller's loop thread right
    after the first message it handles after which `condition()` holds. The moment is a point of the
    controller's own state (e.g. its n-th sampled token), so a loaded machine that wakes the test's
    event loop late cannot move the failure past the end of the requests. Returns the list of
    `ctrl.generated` at each action (what has fired)."""
    fired: list[int] = []
    handle = ctrl.handle

    def hooked(msg, tensor) -> None:
        handle(msg, tensor)
        if len(fired) < len(steps) and steps[len(fired)][0]():
            fired.append(ctrl.generated)
            steps[len(fired) - 1][1]()

    ctrl.handle = hooked
    return fired
