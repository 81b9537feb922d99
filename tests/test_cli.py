"""The CLI's argument checks that come before any compile."""

import pytest

from dsv41_passes import cli


@pytest.mark.parametrize("kind", ["file", "below_a_file"])
def test_inspect_dump_that_cannot_be_a_directory_is_a_usage_error(tmp_path, kind, capsys):
    f = tmp_path / "f"
    f.write_text("")
    dump = f if kind == "file" else f / "sub"
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "--dump", str(dump)])
    assert e.value.code == 2
    assert "--dump: cannot make directory" in capsys.readouterr().err
