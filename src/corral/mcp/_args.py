"""Each tool's arguments as a pydantic model: the model is the JSON schema the tool lists (its descriptions are
written for the model that calls it) and the check of what a call sends. Unknown fields are refused, so a
misspelt argument is an error the caller sees, not a default that silently applies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

__all__ = ["CheckpointArgs", "CheckpointRefArgs", "CreateArgs", "FileArgs", "KillArgs", "ListArgs",
           "ListChangesArgs", "ListFilesArgs", "NoArgs", "ReadArgs", "RestoreArgs", "RunCodeArgs", "RunCommandArgs",
           "WriteArgs"]

MAX_SANDBOX_TIMEOUT = 7 * 24 * 3600  # the REST API's ceiling for a sandbox's time to live
MAX_CALL_TIMEOUT = 3600  # a command or cell longer than an hour belongs in the background, not in one tool call

SandboxId = Annotated[StrictStr, Field(min_length=1, max_length=128,
                                       description="The sandbox's id, as create_sandbox or list_sandboxes gave it "
                                                   "(\"sb-...\").")]
Path = Annotated[StrictStr, Field(min_length=1, max_length=4096,
                                  description="A path inside the sandbox; a relative one is under /workspace.")]
Encoding = Literal["text", "base64"]
CheckpointRef = Annotated[StrictStr, Field(min_length=1, max_length=128,
                                           description="A checkpoint's id (\"ckpt-...\", as checkpoint, "
                                                       "list_checkpoints or an automatic checkpoint's result gave "
                                                       "it) or its name.")]
MAX_RESTORE_PATHS = 64  # paths of one restore: more is a restore of the whole sandbox


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoArgs(_Args):
    pass


class CreateArgs(_Args):
    template: StrictStr = Field("default", min_length=1, max_length=256,
                                description="The template to start from; \"default\" has Python 3 (numpy, pandas, "
                                            "matplotlib, scikit-learn), Node.js, bash, gcc/g++, curl and git.")
    network: StrictStr | list[StrictStr] = Field(
        "none", description="Outbound network: \"none\" (the default: no network at all), \"internet\" (public "
                            "addresses), or a list of domains the sandbox may reach, wildcards allowed "
                            "([\"pypi.org\", \"*.pythonhosted.org\"]).")
    timeout: float = Field(300, gt=0, le=MAX_SANDBOX_TIMEOUT,
                           description="Seconds the sandbox lives; it is destroyed with all its files after that.")
    checkpoints: Literal["auto", "manual"] | None = Field(
        None, description="\"auto\": a checkpoint is taken before every run_command, run_code and write_file, and "
                          "each result carries its id (\"checkpoint\"), so any step can be undone with restore; "
                          "\"manual\": only the checkpoints you take with the checkpoint tool. Default: the "
                          "tenant's setting (else manual).")


class ListArgs(NoArgs):
    pass


class KillArgs(_Args):
    sandbox_id: SandboxId


class RunCommandArgs(_Args):
    sandbox_id: SandboxId
    command: StrictStr = Field(min_length=1, description="A shell command line, run with `bash -lc` as the "
                                                          "sandbox user in /workspace (pipes, && and globs work).")
    timeout: float = Field(60, gt=0, le=MAX_CALL_TIMEOUT,
                           description="Seconds before the command is killed (it then reports timed_out).")
    cwd: Path | None = Field(None, description="Working directory (default /workspace).")


class RunCodeArgs(_Args):
    sandbox_id: SandboxId
    code: StrictStr = Field(description="The code of one cell. Python is stateful like a notebook: variables, "
                                        "imports and open figures persist between calls in the same sandbox.")
    language: StrictStr = Field("python", min_length=1, max_length=32,
                                description="python (default), javascript, bash, c or cpp; others (java, go, "
                                            "rust, typescript, r) need a template that has their toolchains.")
    timeout: float = Field(120, gt=0, le=MAX_CALL_TIMEOUT,
                           description="Seconds before the cell is interrupted (it then reports timed_out).")


class FileArgs(_Args):
    sandbox_id: SandboxId
    path: Path


class ReadArgs(FileArgs):
    encoding: Encoding = Field("text", description="\"text\": the file as UTF-8 text (a file that is not valid "
                                                  "UTF-8 is refused, never altered); \"base64\": its exact bytes, "
                                                  "base64-encoded (for binary files).")


class WriteArgs(FileArgs):
    content: StrictStr = Field(description="What the file will hold: text, or base64 of its bytes (see encoding).")
    encoding: Encoding = Field("text", description="\"text\": content is written as UTF-8; \"base64\": content is "
                                                  "decoded from base64 and those exact bytes are written.")


class ListFilesArgs(_Args):
    sandbox_id: SandboxId
    path: Path = "/workspace"
    depth: int = Field(1, ge=1, le=5, description="1: the directory's own entries; more: that many levels down.")


class CheckpointArgs(_Args):
    sandbox_id: SandboxId
    name: StrictStr | None = Field(None, min_length=1, max_length=128,
                                   description="A name to find it by later (unique in the sandbox; letters, "
                                               "digits, '.', '_', '-'). A named checkpoint is never removed to "
                                               "make room, only by delete_checkpoint.")


class CheckpointRefArgs(_Args):
    sandbox_id: SandboxId
    checkpoint: CheckpointRef


class RestoreArgs(CheckpointRefArgs):
    paths: list[Path] | None = Field(None, min_length=1, max_length=MAX_RESTORE_PATHS,
                                     description="Restore only these paths (each with everything below it) and "
                                                 "leave every other file as it is now; a path that did not exist "
                                                 "at the checkpoint is removed. Default: every file.")


class ListChangesArgs(_Args):
    sandbox_id: SandboxId
    since: CheckpointRef
    until: CheckpointRef | None = Field(None, description="A later checkpoint to compare to (default: the files "
                                                          "as they are now).")
    diff: bool = Field(False, description="Also return a unified diff of each changed text file (bounded).")
