"""The Lua scripts by which the Redis stream store (stores/resumable_redis.py) changes a stream: each reads the stream's
state and writes in one step, so that two replicas never interleave between the check and the write.

Keys: ``KEYS[1]`` the stream's hash (``state``, ``last``, ``position``, ``progress``, ``why``), ``KEYS[2]`` its
Redis Stream of events, then, where a script takes them, its alive key and its reader key (stores/resumable_redis.py's
``Keys``).
"""

from __future__ import annotations

# ARGV: seq, kind, data, final ('1' | '0'), maxlen, ttl (events and alive), meta ttl
APPEND = """
local f = redis.call('HMGET', KEYS[1], 'state', 'last')
if f[1] ~= 'live' then return f[1] or 'missing' end
if tonumber(f[2]) + 1 ~= tonumber(ARGV[1]) then return 'out_of_order' end
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[5], '0-' .. (tonumber(ARGV[1]) + 1), 'kind', ARGV[2], 'data', ARGV[3])
redis.call('HSET', KEYS[1], 'last', ARGV[1], 'position', 0, 'progress', '')
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'state', 'ended') end
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return 'ok'
"""

# Set a state (the queue position, the prompt's progress) of a live stream before its first item. ARGV: field, value …
STATE = """
local f = redis.call('HMGET', KEYS[1], 'state', 'last')
if f[1] ~= 'live' or f[2] ~= '-1' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# End a stream. ARGV: kind, data (the final item, appended only to a live stream), state ('ended': only a live
# stream ends; 'gone': any stream not gone yet goes), why, maxlen, tombstone ttl, gone events ttl.
# Returns {state before, why}.
END = """
local f = redis.call('HMGET', KEYS[1], 'state', 'last', 'why')
if not f[1] then return {'missing', ''} end
if f[1] == 'gone' then return {'gone', f[3] or ''} end
if ARGV[3] == 'ended' and f[1] ~= 'live' then return {f[1], ''} end
if f[1] == 'live' then
  local seq = tonumber(f[2]) + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[5], '0-' .. (seq + 1), 'kind', ARGV[1], 'data', ARGV[2])
  redis.call('HSET', KEYS[1], 'last', seq, 'position', 0, 'progress', '')
end
redis.call('HSET', KEYS[1], 'state', ARGV[3])
if ARGV[3] == 'gone' then
  redis.call('HSET', KEYS[1], 'why', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[6])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  redis.call('DEL', KEYS[3])
end
return {f[1], ''}
"""

# Expire a stream nobody has read for the grace. ARGV: why (ended), why (live), tombstone ttl, gone events ttl.
# Returns {outcome, why, state before}: outcome 'alive', 'gone' (already) or 'expired'.
EXPIRE = """
local f = redis.call('HMGET', KEYS[1], 'state', 'why')
if not f[1] then return {'missing', '', ''} end
if f[1] == 'gone' then return {'gone', f[2] or '', 'gone'} end
if redis.call('EXISTS', KEYS[3]) == 1 or redis.call('EXISTS', KEYS[4]) == 1 then return {'alive', '', f[1]} end
local why = ARGV[2]
if f[1] == 'ended' then why = ARGV[1] end
redis.call('HSET', KEYS[1], 'state', 'gone', 'why', why)
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return {'expired', why, f[1]}
"""

# ARGV: token
DETACH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
