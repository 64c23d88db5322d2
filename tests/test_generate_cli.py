"""`kvflow generate` / `kvflow chat` on a tiny checkpoint directory, in-process."""

from __future__ import annotations

import io

from kvflow.cli.main import main


def test_generate_streams_text_and_stats(tiny_ckpt_dir, capsys):
    rc = main(["generate", "w10 w11 w12", "--raw", "--model", str(tiny_ckpt_dir), "--max-tokens", "5", "--ignore-eos", "--stats"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert len(out.strip().split(" ")) == 5 and all(w.startswith("w") or w.startswith("<") for w in out.split())
    assert "5 tokens" in err and "finish: length" in err


def test_generate_applies_chat_template_by_default(tiny_ckpt_dir, capsys):
    assert main(["generate", "w10", "--model", str(tiny_ckpt_dir), "--max-tokens", "3", "--ignore-eos"]) == 0
    assert len(capsys.readouterr().out.split()) == 3


def test_bad_flags_exit_2_with_message(tiny_ckpt_dir, capsys):
    assert main(["generate", "w10", "--model", str(tiny_ckpt_dir), "--top-p", "0"]) == 2
    assert "argument --top-p: must be > 0, got 0" in capsys.readouterr().err
    assert main(["generate", "w10", "--model", "/nonexistent/model.gguf"]) == 2
    assert "not found" in capsys.readouterr().err


def test_chat_keeps_history_and_exits(tiny_ckpt_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("w10 w11\n/reset\nw12\n/exit\n"))
    assert main(["chat", "--model", str(tiny_ckpt_dir), "--max-tokens", "3", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.count(">>> ") == 4 and len([l for l in out.splitlines() if l.strip(" >")]) == 2
