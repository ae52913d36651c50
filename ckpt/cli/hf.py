"""``ckpt export-hf`` and ``ckpt import-hf``: Hugging Face interop (the embedded MoE and the adapter
families of :mod:`ckpt.hf`: Llama, Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3)."""

from __future__ import annotations

import typer

from ckpt.cli.common import byte_bar, console, handle_errors, human_bytes, parse_storage_options, print_json
from ckpt.hf.convert import export_hf, import_hf

StorageOpt = typer.Option(None, "--storage-option", "-o", help="backend option key=value (repeatable)")
BudgetOpt = typer.Option("512MiB", "--memory-budget",
                         help="bytes of data buffers, e.g. 1GiB (peak memory: this + the largest tensor)")
WorkersOpt = typer.Option(4, "--workers", min=1, help="parallel readers")


@handle_errors
def export_hf_cmd(
    src: str = typer.Argument(..., help="checkpoint directory or URL (any layout)"),
    out: str = typer.Argument(..., help="output directory for the Hugging Face model"),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: as stored)"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors file, e.g. 5GB"),
    memory_budget: str = BudgetOpt,
    workers: int = WorkersOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a model already in OUT"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    no_verify_source: bool = typer.Option(False, "--no-verify-source",
                                          help="skip checking the source's checksums (corruption would be exported)"),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="copy tokenizer / generation-config files "
                                                                      "from this directory (default: those "
                                                                      "import-hf kept in the checkpoint)"),
    check: bool = typer.Option(False, "--check", help="reload the export with transformers and compare logits "
                                                      "with the source (recorded in OUT/ckpt_check.json)"),
    config: str | None = typer.Option(None, "--config", help="the model's Hugging Face config.json (or a model "
                                                            "directory): needed for checkpoints import-hf did not "
                                                            "write, e.g. torchtitan or Megatron ones"),
    source_names: str = typer.Option("auto", "--source-names",
                                     help="how SRC names the weights: auto | ckpt | hf | torchtitan | megatron | "
                                          "a JSON names file (auto: as import-hf recorded, else detected from "
                                          "the keys; torchtitan covers its old and 0.3 names)"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Export the model weights of SRC (a ckpt, DCP/torchtitan, Megatron or DeepSpeed checkpoint, any layout)
    as a Hugging Face model (config.json, safetensors, index). Every source shard's checksum is checked on the
    way; a corrupted source stops the export and removes what it wrote (exit 3)."""
    with byte_bar("export", not (quiet or json_out)) as progress:
        r = export_hf(src, out, dtype=dtype, max_shard_size=max_shard_size, memory_budget=memory_budget,
                      workers=workers, overwrite=overwrite, storage_options=parse_storage_options(storage_option),
                      progress=progress, verify_source=not no_verify_source, tokenizer=tokenizer, config=config,
                      source_names=source_names)
    checked = None
    if check:
        from ckpt.hf.check import check_export

        checked = check_export(src, out, config=config, source_names=source_names)
    if json_out:
        print_json(r.to_dict() | ({"check": checked} if checked else {}))
        return
    console.print(f"wrote {r.out_dir}: {r.tensors} tensors ({r.dtype}, {human_bytes(r.total_size)}) in "
                  f"{len(r.files)} file(s), {r.seconds:.1f} s", highlight=False)
    if checked:
        console.print(f"check: reloaded in transformers {checked['transformers']}; max |logits difference| "
                      f"{checked['max_abs_logits_diff']:.2e} over {checked['tokens']} tokens", highlight=False)


@handle_errors
def import_hf_cmd(
    hf_dir: str = typer.Argument(..., help="Hugging Face model directory (config.json + safetensors)"),
    dst: str = typer.Argument(..., help="checkpoint directory or URL to write"),
    to: str | None = typer.Option(None, "--to", help="target layout, e.g. tp=2,ep=2 (default: single)"),
    dtype: str | None = typer.Option(None, "--dtype", help="cast to bf16 | fp16 | fp32 (default: keep)"),
    memory_budget: str = BudgetOpt,
    workers: int = WorkersOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a committed checkpoint at DST"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    names: str = typer.Option("ckpt", "--names", help="key names to write: ckpt | hf | torchtitan | megatron | "
                                                      "a JSON names file"),
    dequantize: bool = typer.Option(False, "--dequantize", help="FP8 block-scaled models: compute the weights "
                                    "(--dtype, default bf16) as transformers does, instead of keeping fp8 + scales"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Import a Hugging Face model (Llama, Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3) as a weights-only
    checkpoint (keeping its tokenizer, chat template and generation config for export-hf); a Qwen3-MoE the
    embedded MoE can represent becomes a checkpoint the trainer can start from."""
    with byte_bar("import", not (quiet or json_out)) as progress:
        r = import_hf(hf_dir, dst, to=to, dtype=dtype, memory_budget=memory_budget, workers=workers,
                      overwrite=overwrite, storage_options=parse_storage_options(storage_option), progress=progress,
                      names=names, dequantize=dequantize)
    if json_out:
        print_json(r.to_dict())
        return
    console.print(f"wrote {r.dst_url}: {r.tensors} tensors ({human_bytes(r.total_bytes)}), layout {r.layout}, "
                  f"{r.seconds:.1f} s", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``export-hf`` and ``import-hf`` to the app."""
    app.command("export-hf")(export_hf_cmd)
    app.command("import-hf")(import_hf_cmd)


__all__ = ["StorageOpt", "BudgetOpt", "WorkersOpt", "export_hf_cmd", "import_hf_cmd", "register"]
