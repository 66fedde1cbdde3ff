#!/usr/bin/env bash
# Proves the README's first command on a machine as a new user has it: a clean RUSTUP_HOME and
# CARGO_HOME (no toolchain, no crates), rustup's auto-install turned off. It runs the command
# exactly as the README prints it, waits for the ready lines, sends the printed curl request,
# runs the printed `switchyard policy push` (live swap to least-load, with the generated admin
# token read from the file the gateway names, since stdout here is no terminal) and checks that
# the next answer was routed by it. Used by .ci/run; the test command is proven the same way there.
set -euo pipefail
cd "$(dirname "$0")/.."

# The first ```sh block after "## Run the embedded default".
command=$(awk '/^## Run the embedded default/ { section = 1 } section && /^```sh/ { block = 1; next }
               block && /^```/ { exit } block { print }' README.md)
[ -n "$command" ] || { echo "no command found in README.md" >&2; exit 1; }
echo "README command: $command" >&2

out=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$out"' EXIT
setsid bash -c "$command" >"$out/stdout" 2>"$out/stderr" &
pid=$!

# A release build from nothing: allow it 40 minutes.
for _ in $(seq 1 2400); do
    grep -q '^try: curl' "$out/stdout" 2>/dev/null && break
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "the README command exited early:" >&2
        tail -40 "$out/stderr" >&2
        exit 1
    fi
    sleep 1
done
grep -q '^try: curl' "$out/stdout" || { echo "no ready line within 40 minutes" >&2; tail -40 "$out/stderr" >&2; exit 1; }
cat "$out/stdout" >&2

curl_line=$(sed -n 's/^try: //p' "$out/stdout")
push_line=$(sed -n 's/^swap the router live: //p' "$out/stdout")
[ -n "$push_line" ] || { echo "no push example in the ready output" >&2; exit 1; }

# The example request as printed, with its headers, streamed.
eval "$curl_line -sS -D $out/headers1" >"$out/answer1"
grep -q 'data: \[DONE\]' "$out/answer1" || { echo "the printed curl got no complete stream" >&2; cat "$out/answer1" >&2; exit 1; }
grep -qi '^x-switchyard-policy: kv-aware' "$out/headers1" || { echo "first answer not routed by kv-aware" >&2; cat "$out/headers1" >&2; exit 1; }

# The printed push command, as printed.
eval "$push_line" >&2
eval "$curl_line -sS -D $out/headers2" >"$out/answer2"
grep -qi '^x-switchyard-policy: least-load' "$out/headers2" || { echo "after the push, the answer was not routed by least-load" >&2; cat "$out/headers2" >&2; exit 1; }
# The printed request with an image, as printed: encoded by the embedded vision encoder and
# merged by the worker (its merge report comes back), not answered text-only.
image_line=$(sed -n 's/^try an image: //p' "$out/stdout")
[ -n "$image_line" ] || { echo "no image example in the ready output" >&2; exit 1; }
eval "$image_line -sS -D $out/headers3" >"$out/answer3"
grep -qi '^x-switchyard-merge: len=' "$out/headers3" || { echo "the image request was not merged" >&2; cat "$out/headers3" "$out/answer3" >&2; exit 1; }
echo "fresh machine: the README command built, served, encoded an image, and swapped its policy live" >&2
kill -TERM -- -"$pid" 2>/dev/null || kill "$pid"
