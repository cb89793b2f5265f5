"""What a Chainer user meets before Chainer runs: the error when it is missing, and the NumPy 2 helper.

chainer_on_numpy2 changes NumPy only when a program calls it, and then as Chainer needs. Each check runs
in a fresh interpreter, so no stand-in leaks into the other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

NUMPY_2 = int(np.__version__.split(".")[0]) >= 2


def run(code: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_importing_cupy_amp_chainer_changes_nothing_in_numpy() -> None:
    result = run(
        "import json, sys, numpy as np; had = 'sctypes' in vars(np); import cupy_amp.chainer; "
        "print(json.dumps({'sctypes': ('sctypes' in vars(np)) != had, "
        "'system_info': 'numpy.distutils.system_info' in sys.modules}))"
    )
    assert result == {"sctypes": False, "system_info": False}


@pytest.mark.skipif(not NUMPY_2, reason="NumPy 1 has both names: the helper does nothing there")
def test_on_numpy2_it_gives_sctypes_and_a_system_info_without_distutils() -> None:
    # Python 3.12+ has no numpy.distutils at all: blocked here to stand for it.
    result = run(
        "import json, sys, numpy as np; sys.modules['numpy.distutils'] = None; "
        "from cupy_amp.chainer import chainer_on_numpy2; chainer_on_numpy2(); chainer_on_numpy2(); "
        "from numpy.distutils.system_info import get_info; "
        "print(json.dumps({'float': [t.__name__ for t in np.sctypes['float']], 'int': len(np.sctypes['int']), "
        "'info': get_info('blas_opt')}))"
    )
    assert result["float"] == ["float16", "float32", "float64", np.longdouble.__name__]
    assert result["int"] == 4
    assert result["info"] == {}


def test_on_numpy1_it_does_nothing() -> None:
    result = run(
        "import json, numpy as np; before = sorted(vars(np)); "
        "np.__version__ = '1.26.4'; from cupy_amp.chainer import chainer_on_numpy2; chainer_on_numpy2(); "
        "print(json.dumps({'changed': sorted(vars(np)) != before}))"
    )
    assert result == {"changed": False}


def test_attach_without_chainer_says_how_to_install_it() -> None:
    result = run(
        "import json, sys; sys.modules['chainer'] = None; from cupy_amp import GradScaler; "
        "from cupy_amp.chainer import attach\n"
        "try:\n    attach(object(), GradScaler())\n"
        "except ImportError as error:\n    print(json.dumps({'message': str(error)}))"
    )
    message = str(result["message"])
    for needed in ('"setuptools<70"', "--no-build-isolation chainer==7.8.1", "chainer_on_numpy2()"):
        assert needed in message
