"""Directory watches against real runc: inotify in the agent, streamed or polled, with the event names and
sequences E2B's envd produces (and its SDK's tests expect), recursion, entries, bounds and refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import AgentError, InvalidRequestError, NotFoundError, PermissionDeniedError, QuotaExceededError
from corral.agent import watch as agent_watch
from corral.agent.file_access import FileError
from corral.agent.watch import MAX_QUEUED, MAX_WATCHES, Watch, Watches
from corral.engine import Files, SandboxSession, WatchEvent, WatchStream

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

W = "/home/user/w"


def pairs(events: list[WatchEvent]) -> list[tuple[str, str]]:
    return [(e.type, e.name) for e in events]


@pytest.fixture
async def files(sandbox: SandboxSession) -> AsyncIterator[Files]:
    await sandbox.files.make_dir(W)
    yield sandbox.files


async def _next(stream: WatchStream, timeout: float = 10.0) -> WatchEvent:
    return await asyncio.wait_for(anext(stream), timeout)


async def _until(stream: WatchStream, wanted: tuple[str, str]) -> list[WatchEvent]:
    seen: list[WatchEvent] = []
    while not seen or (seen[-1].type, seen[-1].name) != wanted:
        seen.append(await _next(stream))
    return seen


# -- polled watchers: what E2B's sync SDK does (write, then poll at once) --------------------------------------------


async def test_a_new_file_written_in_place_is_exactly_create_chmod_write(files):
    watcher = await files.create_watcher(W)
    await files.write(f"{W}/new.txt", b"content", in_place=True)
    assert pairs(await files.watcher_events(watcher)) == [("create", "new.txt"), ("chmod", "new.txt"),
                                                          ("write", "new.txt")]
    await files.write(f"{W}/new.txt", b"rewritten", in_place=True)
    events = pairs(await files.watcher_events(watcher))
    assert ("write", "new.txt") in events and ("create", "new.txt") not in events
    assert await files.watcher_events(watcher) == []  # each poll takes what came since the last
    await files.remove_watcher(watcher)


async def test_the_default_atomic_write_shows_a_temporary_name_renamed_onto_the_file(files):
    watcher = await files.create_watcher(W)
    await files.write(f"{W}/atomic.txt", b"content")
    events = pairs(await files.watcher_events(watcher))
    assert events[-1] == ("create", "atomic.txt") and ("write", "atomic.txt") not in events  # IN_MOVED_TO
    assert events[0][0] == "create" and events[0][1].startswith(".corral-upload-")


async def test_a_recursive_watcher_names_nested_files_relative_to_the_watched_directory(files):
    await files.make_dir(f"{W}/nested")
    watcher = await files.create_watcher(W, recursive=True)
    await files.write(f"{W}/nested/f.txt", b"x", in_place=True)
    assert pairs(await files.watcher_events(watcher)) == [("create", "nested/f.txt"), ("chmod", "nested/f.txt"),
                                                          ("write", "nested/f.txt")]


async def test_a_recursive_watcher_watches_directories_made_after_it(files):
    watcher = await files.create_watcher(W, recursive=True)
    await files.make_dir(f"{W}/later")
    await files.write(f"{W}/later/f.txt", b"x", in_place=True)
    events = pairs(await files.watcher_events(watcher))
    assert ("create", "later") in events and ("write", "later/f.txt") in events


async def test_what_a_new_directory_holds_before_it_is_watched_is_reported(sandbox, files):
    watcher = await files.create_watcher(W, recursive=True)
    # Faster than any watch can be added: the tree and the file exist before their directories are watched.
    await sandbox.exec(f"mkdir -p {W}/a/b/c && echo data > {W}/a/b/c/f && mkdir {W}/a/b/c/d")
    await sandbox.exec(f"echo more >> {W}/a/b/c/f")  # and from now on it is watched for real
    events = pairs(await files.watcher_events(watcher))
    for name in ("a", "a/b", "a/b/c", "a/b/c/f", "a/b/c/d"):
        assert ("create", name) in events, name
    assert events.count(("write", "a/b/c/f")) >= 2  # written before it was watched, and after


async def test_remove_and_rename_events_and_the_watched_directory_itself(files):
    await files.write(f"{W}/a", b"a")
    watcher = await files.create_watcher(W)
    await files.rename(f"{W}/a", f"{W}/b")
    await files.remove(f"{W}/b")
    await files.remove(W)
    assert pairs(await files.watcher_events(watcher)) == [("rename", "a"), ("create", "b"), ("remove", "b"),
                                                          ("remove", ".")]


async def test_include_entry_gives_the_entry_of_create_write_and_chmod_events(files):
    watcher = await files.create_watcher(W, include_entry=True)
    await files.write(f"{W}/e.txt", b"hello", in_place=True, metadata={"k": "v"})
    await files.remove(f"{W}/e.txt")
    events = await files.watcher_events(watcher)
    write = next(e for e in events if e.type == "write")
    assert write.entry is not None and (write.entry.name, write.entry.path, write.entry.type) == \
        ("e.txt", f"{W}/e.txt", "file")
    assert events[-1].type == "remove" and events[-1].entry is None
    no_entries = await files.create_watcher(W)
    await files.write(f"{W}/f.txt", b"x", in_place=True)
    assert all(e.entry is None for e in await files.watcher_events(no_entries))


async def test_a_full_queue_leaves_one_overflow_event_and_the_watcher_goes_on(sandbox, files):
    watcher = await files.create_watcher(W)
    many = MAX_QUEUED + 500
    await sandbox.exec(["python3", "-c", f"[open(f'{W}/f{{i}}', 'w').close() for i in range({many})]"])
    events = await files.watcher_events(watcher)
    assert len(events) == MAX_QUEUED + 1 and events[-1] == WatchEvent("overflow", "")
    assert {e.type for e in events[:-1]} == {"create"}
    await files.write(f"{W}/after", b"x", in_place=True)
    assert pairs(await files.watcher_events(watcher))[0] == ("create", "after")


async def test_watchers_are_bounded_and_belong_to_their_owner(files):
    ids = [await files.create_watcher(W, owner="me") for _ in range(MAX_WATCHES)]
    with pytest.raises(QuotaExceededError):
        await files.create_watcher(W)
    with pytest.raises(QuotaExceededError):
        await files.watch(W)
    with pytest.raises(NotFoundError):  # another owner's watcher does not exist for it
        await files.watcher_events(ids[0], owner="someone else")
    with pytest.raises(NotFoundError):
        await files.remove_watcher(ids[0], owner="someone else")
    await files.remove_watcher(ids[0], owner="me")
    with pytest.raises(NotFoundError):
        await files.watcher_events(ids[0], owner="me")
    ids[0] = await files.create_watcher(W, owner="me")
    with pytest.raises(NotFoundError):
        await files.watcher_events("w-nonexistent")


# -- refusals (both ways) ----------------------------------------------------------------------------------------------


async def test_a_file_a_missing_path_and_a_path_outside_the_roots_are_refused(engine, sandbox, files):
    await files.write(f"{W}/file.txt", b"x")
    confined = engine.get(sandbox.id).files_for(roots=["/workspace"])
    cases = [(f"{W}/file.txt", files, InvalidRequestError), (f"{W}/missing", files, NotFoundError),
             (W, confined, PermissionDeniedError), ("/workspace/../home/user", confined, PermissionDeniedError)]
    for path, api, error in cases:
        with pytest.raises(error):
            await api.create_watcher(path)
        with pytest.raises(error):
            await api.watch(path)
    assert len([await files.create_watcher(W) for _ in range(MAX_WATCHES)]) == MAX_WATCHES  # refusals hold no slot


# -- streams -------------------------------------------------------------------------------------------------------


async def test_a_stream_carries_events_as_they_happen_until_it_is_closed(files):
    async with await files.watch(W, recursive=True, include_entry=True) as stream:
        await files.write(f"{W}/s.txt", b"streamed", in_place=True)
        seen = await _until(stream, ("write", "s.txt"))
        assert pairs(seen) == [("create", "s.txt"), ("chmod", "s.txt"), ("write", "s.txt")]
        assert seen[-1].entry is not None and seen[-1].entry.size == 8
        await files.make_dir(f"{W}/sub")
        await files.write(f"{W}/sub/t.txt", b"x", in_place=True)
        assert ("write", "sub/t.txt") in pairs(await _until(stream, ("write", "sub/t.txt")))
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_a_closed_stream_gives_its_place_back(files):
    ids = [await files.create_watcher(W) for _ in range(MAX_WATCHES - 1)]
    stream = await files.watch(W)
    with pytest.raises(QuotaExceededError):
        await files.create_watcher(W)
    await stream.aclose()
    for _ in range(50):  # the agent ends its side when it sees the connection close
        try:
            ids.append(await files.create_watcher(W))
            break
        except QuotaExceededError:
            await asyncio.sleep(0.05)
    assert len(ids) == MAX_WATCHES


async def test_a_stream_of_a_sandbox_that_goes_away_ends_with_an_error_not_a_hang(sandbox, files):
    stream = await files.watch(W)
    waiting = asyncio.ensure_future(_next(stream, timeout=30))
    await asyncio.sleep(0.2)
    await sandbox.destroy()
    with pytest.raises(AgentError):
        await waiting


# -- the agent's bounds, in this process (inotify works here too) ---------------------------------------------------


def test_a_recursive_watch_of_too_many_directories_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_watch, "MAX_DIRS", 4)
    for name in ("a/b", "c", "d"):
        (tmp_path / name).mkdir(parents=True)
    with pytest.raises(FileError) as refused:
        Watch(str(tmp_path), recursive=True)
    assert refused.value.code == "quota_exceeded"
    Watch(str(tmp_path / "a"), recursive=True).close()  # a smaller tree is fine


def test_a_watcher_nobody_polls_expires(tmp_path: Path) -> None:
    registry = Watches()
    idle, fresh = Watch(str(tmp_path)), Watch(str(tmp_path))
    registry._watchers.update({"w-idle": (idle, "o"), "w-fresh": (fresh, "o")})
    idle.last_used -= agent_watch.IDLE_SECONDS + 1
    registry._expire()
    assert list(registry._watchers) == ["w-fresh"] and idle.closed and not fresh.closed
    fresh.close()
