"""Stage the embedded model for scripts/gpu_check.sh on a machine that reaches no package index: the 98 MB
SmolLM2 GGUF in two halves (.gpu/a and .gpu/b, each with the checksum), and a tokenizer-only GGUF (its metadata,
no tensors, 1.7 MB) in .gpu/a so that tests which only need the tokenizer run before the second half arrives.

    python -m bench.gpu_check_prepare [--first-part-mib 42]
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
from pathlib import Path

import mii


def tokenizer_only(src: Path, dst: Path) -> None:
    """Copy every metadata field of a GGUF (architecture, hyperparameters, tokenizer, chat template), no tensors."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    arch = r.fields["general.architecture"]
    w = GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                values = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                values = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, values, kind, sub_type=sub)
        elif kind == GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[f.data[0]]).decode(), kind)
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--first-part-mib", type=int, default=42)
    args = ap.parse_args()
    src = Path(mii.default_model())
    data = src.read_bytes()
    cut = args.first_part_mib << 20
    root = Path(".gpu")
    shutil.rmtree(root, ignore_errors=True)
    manifest = f"{hashlib.sha256(data).hexdigest()} 2\n"
    for name, chunk in (("a", data[:cut]), ("b", data[cut:])):
        (root / name).mkdir(parents=True)
        (root / name / f"smollm2.part{1 if name == 'a' else 2}").write_bytes(chunk)
        (root / name / "smollm2.sha256").write_text(manifest)
    tokenizer_only(src, root / "a" / "tokenizer-only.gguf")
    for d in ("a", "b"):
        size = sum(f.stat().st_size for f in (root / d).iterdir())
        print(f".gpu/{d}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
