# The C style of .clang-format: applied by make format, checked by make test (test-format).
# clang-format is Debian's (tools/setup/deps.sh); every C, CUDA and header
# file git tracks under these folders is formatted.
.PHONY: format test-format

CLANG_FORMAT ?= clang-format
FORMAT_DIRS  := proto kernels daemon client tools tests
# Quoted: git's pathspec, not the shell, matches the * (across folders).
FORMAT_SRC    = $(shell git ls-files -- $(foreach d,$(FORMAT_DIRS),'$(d)/*.c' '$(d)/*.h' '$(d)/*.cu') \
			2>/dev/null)

format:
	$(CLANG_FORMAT) -i $(FORMAT_SRC)

test-format:
	@$(CLANG_FORMAT) --dry-run --Werror $(FORMAT_SRC) || \
		{ echo "test-format: run 'make format' (.clang-format)"; exit 1; }
	@echo "test-format: every C file is formatted as .clang-format says"


test: test-format
