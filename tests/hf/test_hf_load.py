"""--init-from: a sharded model filled from a save_pretrained folder, every rank reading only its rows."""

from __future__ import annotations

import types

import torch
import transformers  # noqa: F401  (the test extra installs it: missing, it must fail, not skip)


from tests.helpers.distributed import run_distributed
from tests.helpers.hf_cases import save_folder, tensor_bytes, tokens


def _load_cases(cases):
    """Build each case on meta, shard it (ZeRO-3, 2 ranks), read its rows; logits and bytes read."""
    import shardwise
    from shardwise.hf.mapping import hf_to_gpt_fields
    from shardwise.hf.models import load_config
    from shardwise.app.hf_train import build_model
    from shardwise.hf.load import init_from_folder
    from shardwise.models import GPTConfig

    out = {}
    for name, folder, as_hf in cases:
        cfg = types.SimpleNamespace(hf_config=folder if as_hf else "", init_from=folder, meta_init=True,
                                    out_dir=folder + "-run")
        model_cfg = None if as_hf else GPTConfig(**hf_to_gpt_fields(load_config(folder)))
        model, init_fn, units = build_model(cfg, model_cfg, torch.device("cpu"))
        model = shardwise.fully_shard(model, unit_modules=units, init_fn=init_fn)
        init_fn.finish()
        stats = init_fn.load_result
        with torch.no_grad():
            logits = model.eval()(tokens())
        whole = None
        if name == "llama" and not as_hf:  # the usual way, every rank loads the whole file: same weights
            before = {n: p.to_local().clone() for n, p in model.named_parameters()}
            whole = init_from_folder(model, folder, model_cfg, whole=True)
            assert all(torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
            whole = whole.bytes_read
        out[(name, as_hf)] = (logits, stats.bytes_read, stats.unused_keys, whole)
    return out


def test_init_from_reads_own_rows_and_matches_transformers(tmp_path):
    folders, expected = {}, {}
    for name in ("llama", "mixtral", "qwen2"):
        folders[name] = tmp_path / name
        # the Llama folder is sharded with an index, the others are one model.safetensors
        expected[name] = save_folder(folders[name], name, **({"max_shard_size": "40KB"} if name == "llama" else {}))
    assert (folders["llama"] / "model.safetensors.index.json").is_file()
    cases = [("llama", str(folders["llama"]), False), ("llama", str(folders["llama"]), True),
             ("mixtral", str(folders["mixtral"]), False), ("mixtral", str(folders["mixtral"]), True),
             ("qwen2", str(folders["qwen2"]), True)]
    ranks = run_distributed(_load_cases, 2, cases)
    for name, _, as_hf in cases:
        total = tensor_bytes(folders[name])
        per_rank = [r[(name, as_hf)][1] for r in ranks]
        what = f"{name} as {'transformers model' if as_hf else 'shardwise GPT'}"
        for r in ranks:
            logits, _, unused, _ = r[(name, as_hf)]
            torch.testing.assert_close(logits, expected[name], rtol=0, atol=1e-5, msg=what)
            assert unused == [], what
        # ZeRO-3 on 2 ranks: every byte is read once, by the rank that holds it
        assert sum(per_rank) == total and max(per_rank) <= 0.55 * total, (what, per_rank, total)
    assert [r[("llama", False)][3] for r in ranks] == [tensor_bytes(folders["llama"])] * 2  # whole: everything
