-- wrk script for benchmarks/bench.py: POST pre-generated JSON bodies, in file order, round and
-- round (multi-turn conversations are laid out turn by turn, so each conversation's history
-- grows in order).
--
-- Arguments (after `--`): BODIES_FILE [PATH] [TAG]
--   BODIES_FILE  one JSON body per line (JSON never holds a raw newline)
--   PATH         request path, default /v1/chat/completions
--   TAG          this run's tag: every marker {{N}} in a body becomes "TAG-THREAD-ROUND"
--                (ROUND counts the passes over the file), so no run and no pass repeats the
--                text of another, while within a pass a conversation's history repeats
--                exactly, as a chat client resends it
--
-- done() prints one line "BENCH_JSON {...}" with the run's counts for bench.py to parse.
-- Bodies are never printed.

local bodies, count, sent = {}, 0, 0
local path, tag, headers
local marker = "{{N}}"
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

-- a body as the pieces between its markers, joined with the tag at send time
local function split(line)
  local parts, from = {}, 1
  while true do
    local first, last = line:find(marker, from, true)
    if not first then
      parts[#parts + 1] = line:sub(from)
      return parts
    end
    parts[#parts + 1] = line:sub(from, first - 1)
    from = last + 1
  end
end

function init(args)
  path = args[2] or "/v1/chat/completions"
  tag = args[3] or "w"
  headers = { ["Content-Type"] = "application/json" }
  for line in io.lines(args[1]) do
    if #line > 0 then
      count = count + 1
      bodies[count] = split(line)
    end
  end
  if count == 0 then
    error("no bodies in " .. args[1])
  end
end

function request()
  local round = math.floor(sent / count)
  local parts = bodies[sent % count + 1]
  sent = sent + 1
  local body = table.concat(parts, tag .. "-" .. tostring(tid) .. "-" .. round)
  return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, "read": %d,'
      .. ' "write": %d, "status": %d, "timeout": %d, "latency_p50_us": %d,'
      .. ' "latency_p99_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(99)))
end
