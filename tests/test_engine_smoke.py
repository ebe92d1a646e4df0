import pytest

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


async def test_exec_hello(sandbox):
    r = await sandbox.exec("echo hi")
    assert r.exit_code == 0 and r.stdout == "hi\n"
