"""Reading the GPU runtime's libraries at start: which files, a bounded read."""

from promptstore.serve.libraries import read_libraries, runtime_libraries


def _maps(tmp_path, *paths) -> str:
    lines = [f"7f00-7f01 r-xp 00000000 08:01 {i} {p}" for i, p in enumerate(paths)]
    lines.append("7ffd-7ffe rw-p 00000000 00:00 0")  # anonymous: no path
    maps = tmp_path / "maps"
    maps.write_text("\n".join(lines) + "\n")
    return str(maps)


def test_every_library_the_process_maps_is_read_where_a_cuda_library_is_among_them(tmp_path):
    cuda, other = tmp_path / "cuda" / "lib", tmp_path / "python"
    cuda.mkdir(parents=True)
    other.mkdir()
    for name in ("libcudart.so.12", "libcudnn_engines.so.9"):
        (cuda / name).write_bytes(b"x" * 10)
    (other / "libpython3.so").write_bytes(b"p")
    (other / "libmlx.so").write_bytes(b"m")
    (other / "weights.safetensors").write_bytes(b"w")
    mapped = [cuda / "libcudart.so.12", other / "libpython3.so", other / "libmlx.so", other / "weights.safetensors"]
    found = runtime_libraries(_maps(tmp_path, *mapped, cuda / "libcudart.so.12"))
    # Only what is mapped (not the unmapped cuDNN library beside it), each once, no data files.
    assert [p.name for p in found] == ["libcudart.so.12", "libmlx.so", "libpython3.so"]


def test_without_a_cuda_library_mapped_nothing_is_read(tmp_path):
    lib = tmp_path / "libmlx.so"
    lib.write_bytes(b"m")
    assert runtime_libraries(_maps(tmp_path, lib, tmp_path / "libpython3.so")) == []
    assert runtime_libraries(tmp_path / "missing") == []


def test_the_read_covers_every_byte_skips_what_is_gone_and_stops_at_its_deadline(tmp_path):
    files = []
    for i, size in enumerate((0, 1, 40 << 20)):
        f = tmp_path / f"lib{i}.so"
        f.write_bytes(b"z" * size)
        files.append(f)
    assert read_libraries([*files, tmp_path / "gone.so"])[:2] == (3, 1 + (40 << 20))
    assert read_libraries(files, deadline_s=0.0)[1] == 0
