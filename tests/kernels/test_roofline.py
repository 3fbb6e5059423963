"""The decode-attention roofline: exact bytes, programs from the launcher's heuristic, and the committed table."""

from pathlib import Path

from qkv.kernels.roofline import H200, LLAMA3_8B, RESULTS, decode_bytes, markdown, rows


def test_bytes_of_one_decode_call():
    b = decode_bytes("bfloat16", 1024, 1)
    assert b["kv"] == 2 * 1024 * 8 * 128 * 2 == 4_194_304
    assert b["block_tables"] == 64 * 4 and b["query_output"] == 2 * 32 * 128 * 2 and b["scales"] == 0
    assert b["total"] == 4_194_304 + 256 + 16_384
    fp8 = decode_bytes("fp8_e4m3", 32768, 16, segments=2)
    assert fp8["kv"] == 2 * 16 * 32768 * 8 * 128 and fp8["scales"] == 64
    assert fp8["partials"] == 2 * 16 * 32 * 2 * 130 * 4
    assert decode_bytes("int8_per_token_head", 1024, 1)["scales"] == 2 * 1024 * 8 * 4


def test_rows_programs_and_time():
    table = {(r["cache"], r["context"], r["batch"]): r for r in rows()}
    assert len(table) == 27
    r = table[("fp8_e4m3", 32768, 1)]
    assert (r["segments"], r["programs"], r["merge_programs"]) == (17, 136, 8)
    assert abs(r["roofline_us"] - r["total_bytes"] / 4.8e12 * 1e6) < 1e-9
    assert table[("bfloat16", 32768, 64)]["programs"] == 512 and table[("int8", 8192, 16)]["segments"] == 2
    assert H200.num_sms == 132 and LLAMA3_8B.num_kv_heads == 8


def test_committed_table_is_generated():
    assert Path(RESULTS).read_text() == markdown(), "regenerate: python -m qkv.kernels.roofline"
