"""Collects benchmarks/bench_*.py when the folder is named (`python -m pytest benchmarks --benchmark-enable`):
pyproject's python_files pattern is pytest's default, test_*.py, which names none of them. A file named on the
command line is collected by pytest itself."""
import pytest


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
