# SPDX-License-Identifier: MIT
"""The man pages (man/*.scd) name everything the programs and the header
offer (issue 34): every flag that `shardd --help`, `shardctl --help` and
`shardbench --help` print, every shardctl and shardbench subcommand, and
every function <shardd.h> declares. The programs' own help and the header
are the reference; a flag or call added without its man page fails here,
naming it and the page to edit."""

import os
import re
import subprocess

import pytest

from conftest import ROOT, shardd_bin, shardd_build

MAN = os.path.join(ROOT, "man")
HEADER = os.path.join(ROOT, "client", "shardd.h")

# An option line of a help text starts with its flag, indented by a few
# spaces: "  --socket PATH", "  -b SIZE", "  -h, --help". A flag in a
# description, or at the start of its continuation lines (indented to the
# description's column), is another program's: shardctl's help names
# shardd's --job-linger and --state-dir.
OPTION_LINE = re.compile(r"^ {1,4}(-[a-zA-Z]\b|--[a-z][a-z0-9-]*)(?:, (--[a-z][a-z0-9-]*))?", re.M)


def page(name):
    with open(os.path.join(MAN, name), encoding="utf-8") as f:
        return f.read()


def help_text(binary):
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"{binary} --help exited {p.returncode}: {p.stderr}"
    return p.stdout + p.stderr


def flags_of(text):
    return sorted({f for line in OPTION_LINE.findall(text) for f in line if f})


def named(man, word):
    """`word` occurs in the page as a word of its own (not inside a longer flag or name)."""
    return re.search(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])", man) is not None


def assert_flags_documented(binary, man_page):
    text, man = help_text(binary), page(man_page)
    flags = flags_of(text)
    assert len(flags) > 5, f"too few flags found in {binary} --help: {flags}\n{text}"
    missing = [f for f in flags if not named(man, f)]
    assert missing == [], f"flags of {os.path.basename(binary)} --help missing from man/{man_page}: {missing}"


def test_every_shardd_flag_is_in_shardd_8():
    assert_flags_documented(shardd_bin(), "shardd.8.scd")


def test_every_shardctl_flag_and_command_is_in_shardctl_1():
    binary = os.path.join(shardd_build(), "shardctl")
    assert_flags_documented(binary, "shardctl.1.scd")
    text = help_text(binary)
    commands_block = text.split("Commands:", 1)[1].split("Options:", 1)[0]
    commands = re.findall(r"^  ([a-z][a-z-]*)\b", commands_block, re.M)
    assert len(commands) >= 12, commands
    man = page("shardctl.1.scd")
    # A command is documented where a COMMANDS entry starts with it: "*end* _JOB_".
    entries = set(re.findall(r"^\*([a-z][a-z-]*)\*", man.split("# COMMANDS", 1)[1].split("\n# ", 1)[0],
                             re.M))
    assert sorted(set(commands) - entries) == [], \
        f"shardctl commands without an entry in man/shardctl.1.scd's COMMANDS: {commands}"


def test_every_shardbench_flag_and_subcommand_is_in_shardbench_1():
    binary = os.path.join(shardd_build(), "shardbench")
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is missing: build it with make")
    assert_flags_documented(binary, "shardbench.1.scd")
    text = help_text(binary)
    subcommands = re.search(r"\[options\] ([a-z|-]+)", text).group(1).split("|")
    man = page("shardbench.1.scd")
    assert [s for s in subcommands if not re.search(r"^\*" + re.escape(s) + r"\*$", man, re.M)] == [], \
        f"shardbench subcommands without an entry in man/shardbench.1.scd: {subcommands}"


def header_functions():
    """Every function <shardd.h> declares (static inline helpers included)."""
    with open(HEADER, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)      # comments name calls too
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M)       # macros are not functions
    return sorted(set(re.findall(r"\b(shardd_[a-z0-9_]+)\s*\(", text)))


def test_every_function_of_shardd_h_is_in_libshardd_3():
    functions = header_functions()
    assert len(functions) > 40, functions
    man = page("libshardd.3.scd")
    # Named as a call: "shardd_x(" in the synopsis, "*shardd_x*(" in the text.
    missing = [f for f in functions if not re.search(r"\b" + f + r"\*?\(", man)]
    assert missing == [], f"functions of client/shardd.h missing from man/libshardd.3.scd: {missing}"
