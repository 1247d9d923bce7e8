-- udpverbs.lua: a Wireshark dissector for the traffic between udpverbs daemons.
--
-- Load it with `wireshark -X lua_script:udpverbs.lua` (or `tshark -X ...`),
-- or copy it to ~/.local/lib/wireshark/plugins/ (the README says more).
--
-- What is on the wire (the byte layouts are the Python package's wire/):
--
--   UDP datagram = one link packet (wire/link.py):
--     28-byte link header | SACK blocks (8 B each) | body | CRC32c (4 B)
--   The body of a DATA packet is one message: an 8-byte envelope
--   (wire/envelope.py) naming the QPs, then by the envelope's kind a DDP
--   segment carrying RDMAP (RFC 5041, RFC 5040, RFC 7306), a connection
--   management message (wire/cm.py), a Modified ACK/NACK (wire/flow.py), or
--   a process-group message (wire/lock.py, wire/barrier.py, wire/group.py).
--   INIT, INIT_ACK and COOKIE carry the link set-up; PROBE (padded to the
--   size it tries) and PROBE_ACK path MTU discovery; ACK, KEEPALIVE and
--   ABORT have no body.
--
-- A daemon sends runs of equal-sized datagrams with one UDP_SEGMENT (GSO)
-- call; captured on the sending host, such a run is one UDP "datagram"
-- holding several link packets back to back.  Link packets carry no length,
-- so the run is cut at the smallest size whose every multiple starts what
-- looks like a link header and whose first piece's CRC32c checks.
--
-- Each DDP segment is handed to Wireshark's own iwarp_ddp_rdmap dissector,
-- as MPA hands it the ULPDU without MPA's framing (the link packet replaces
-- MPA's header, markers and CRC).  What that dissector does not decode
-- (RFC 7306's Immediate Data; the atomics it knows only in part) is decoded
-- here, in the "udpverbs_rdmap" tree, which also takes over the whole
-- DDP/RDMAP decoding when the iWARP dissector is missing or turned off in
-- the preferences.

local udpverbs = Proto("udpverbs", "udpverbs link")
local rdmap = Proto("udpverbs_rdmap", "RDMAP over udpverbs (RFC 5040, RFC 5041, RFC 7306)")

local band, bxor, rshift = bit32.band, bit32.bxor, bit32.rshift

-- ---------------------------------------------------------------------------
-- Constants (wire/)
-- ---------------------------------------------------------------------------

local DEFAULT_PORT = 18515 -- daemon/config.py DEFAULT_PORT
local LINK_VERSION = 2
local VERSION_BYTE = string.char(LINK_VERSION)
local HEADER_LEN = 28
local CRC_LEN = 4
local MIN_PACKET = HEADER_LEN + CRC_LEN
-- the cluster key's trailer after each link packet (udpverbsd --key-file): salt, packet number, tag
local AUTH_TRAILER_LEN = 28
local MAX_SACK = 4
local ENVELOPE_LEN = 8
local INIT_LEN = 21 -- with no address: the count byte alone
local COOKIE_LEN = 16
local FLOW_ACK_LEN = 4

local PTYPES = { [1] = "DATA", [2] = "ACK", [3] = "INIT", [4] = "INIT_ACK", [5] = "KEEPALIVE", [6] = "ABORT",
                 [7] = "COOKIE", [8] = "PROBE", [9] = "PROBE_ACK" }
local P_DATA, P_INIT, P_INIT_ACK, P_COOKIE, P_PROBE, P_PROBE_ACK = 1, 3, 4, 7, 8, 9
local KINDS = { [1] = "DDP", [2] = "CM", [3] = "FLOW", [4] = "LOCK", [5] = "BARRIER", [6] = "GROUP" }
local K_DDP, K_CM, K_FLOW, K_LOCK, K_BARRIER, K_GROUP = 1, 2, 3, 4, 5, 6
local ENV_IMM_FOLLOWS, ENV_FLOW_ACK = 0x01, 0x02

-- RFC 5040 §4.2 and RFC 7306: RDMA Message OpCodes
local OPCODES = {
    [0] = "RDMA Write", [1] = "RDMA Read Request", [2] = "RDMA Read Response", [3] = "Send",
    [4] = "Send with Invalidate", [5] = "Send with SE", [6] = "Send with SE and Invalidate", [7] = "Terminate",
    [8] = "Immediate Data", [9] = "Immediate Data with SE", [10] = "Atomic Request", [11] = "Atomic Response",
}
local OP_READ_REQUEST, OP_TERMINATE, OP_IMM, OP_IMM_SE, OP_ATOMIC_REQ, OP_ATOMIC_RESP = 1, 7, 8, 9, 10, 11
-- RFC 7306 Atomic Operation codes
local ATOMIC_OPS = { [0] = "FetchAdd", [1] = "Swap", [2] = "CompareSwap" }
local QUEUES = { [0] = "Send", [1] = "Read/Atomic Request", [2] = "Terminate", [3] = "Atomic Response" }
local TERM_LAYERS = { [0] = "RDMAP", [1] = "DDP", [2] = "LLP" }
-- Terminate error types and codes by layer (RFC 5040 §4.8, RFC 5041 §7.2, RFC 5044 §8)
local TERM_ETYPES = {
    [0] = { [0] = "Local Catastrophic Error", [1] = "Remote Protection Error", [2] = "Remote Operation Error" },
    [1] = { [0] = "Local Catastrophic Error", [1] = "Tagged Buffer Error", [2] = "Untagged Buffer Error",
            [3] = "Reserved for the LLP" },
    [2] = { [0] = "LLP error" },
}
local RDMAP_ECODES = { [0] = "Invalid STag", [1] = "Base or bounds violation", [2] = "Access rights violation",
                       [3] = "STag not associated with RDMAP Stream", [4] = "TO wrap", [5] = "Invalid RDMAP version",
                       [6] = "Unexpected OpCode", [7] = "Catastrophic error, localized to RDMAP Stream",
                       [8] = "Catastrophic error, global", [9] = "STag cannot be invalidated",
                       [0xFF] = "Unspecified error" }
local TERM_ECODES = {
    [0] = { [1] = RDMAP_ECODES, [2] = RDMAP_ECODES },
    [1] = { [1] = { [0] = "Invalid STag", [1] = "Base or bounds violation", [2] = "STag not associated with DDP Stream",
                    [3] = "TO wrap", [4] = "Invalid DDP version" },
            [2] = { [1] = "Invalid QN", [2] = "Invalid MSN - no buffer available", [3] = "Invalid MSN - MSN range is not valid",
                    [4] = "Invalid MO", [5] = "DDP Message too long for available buffer", [6] = "Invalid DDP version" } },
    [2] = { [0] = { [1] = "Stream lost", [2] = "CRC error", [3] = "Framing error", [4] = "Invalid request" } },
}

local CM_TYPES = { [1] = "CONNECT_REQUEST", [2] = "ACCEPT", [3] = "REJECT", [4] = "DISCONNECT" }
local CM_REASONS = { [1] = "no listener", [2] = "refused by the application", [3] = "no resources",
                     [4] = "bad request" }
local FLOW_TYPES = { [1] = "ACK", [2] = "RNR_NACK", [3] = "RESUME" }
local LOCK_TYPES = { [1] = "LOCK_REQ", [2] = "LOCK_FORW", [3] = "LOCK_REPLY", [4] = "UNLOCK", [5] = "TRYLOCK_REQ",
                     [6] = "TRYLOCK_REPLY" }
local LOCK_STATUS = { [0] = "GRANTED", [1] = "BUSY", [2] = "REFUSED", [3] = "OWNER_DIED" }
local BARRIER_TYPES = { [1] = "ARRIVE", [2] = "RELEASE", [3] = "ABORT" }
local BARRIER_ALGORITHMS = { [1] = "TREE", [2] = "DISSEMINATION", [3] = "CENTRAL" }
local GROUP_TYPES = { [1] = "JOIN", [2] = "LEAVE", [3] = "PING", [4] = "PONG" }
local LEAVE_STATUS = { [0] = "LEFT", [1] = "DIED" }
local CRC_STATUS = { [0] = "Bad", [1] = "Good", [2] = "Unverified" }

-- ---------------------------------------------------------------------------
-- Fields
-- ---------------------------------------------------------------------------

local F = ProtoField
local f = {
    version = F.uint8("udpverbs.version", "Version", base.DEC),
    ptype = F.uint8("udpverbs.ptype", "Packet type", base.DEC, PTYPES),
    flags = F.uint8("udpverbs.flags", "Flags", base.HEX),
    ack_now = F.bool("udpverbs.flags.ack_now", "ACK now", 8, nil, 0x01),
    retransmission = F.bool("udpverbs.flags.retransmission", "Retransmission", 8, nil, 0x02),
    path_id = F.uint8("udpverbs.path_id", "Path ID", base.DEC),
    conn_tag = F.uint32("udpverbs.conn_tag", "Connection tag", base.HEX),
    seq = F.uint32("udpverbs.seq", "Sequence number", base.DEC),
    ack = F.uint32("udpverbs.ack", "Cumulative ACK", base.DEC),
    ts_us = F.uint32("udpverbs.ts_us", "Timestamp (us)", base.DEC),
    ts_echo_us = F.uint32("udpverbs.ts_echo_us", "Timestamp echo (us)", base.DEC),
    rwnd = F.uint16("udpverbs.rwnd", "Receive window (packets)", base.DEC),
    sack_count = F.uint8("udpverbs.sack_count", "SACK blocks", base.DEC),
    reserved = F.uint8("udpverbs.reserved", "Reserved", base.HEX),
    sack_start = F.uint32("udpverbs.sack.start", "SACK start", base.DEC),
    sack_end = F.uint32("udpverbs.sack.end", "SACK end", base.DEC),
    body = F.bytes("udpverbs.body", "Body"),
    crc = F.uint32("udpverbs.crc", "CRC32c", base.HEX),
    crc_status = F.uint8("udpverbs.crc.status", "CRC32c status", base.DEC, CRC_STATUS),
    gso = F.uint16("udpverbs.gso_packets", "Link packets in this datagram (GSO)", base.DEC),
    auth_salt = F.uint32("udpverbs.auth.salt", "Cluster key: salt", base.HEX),
    auth_pn = F.uint64("udpverbs.auth.pn", "Cluster key: packet number", base.DEC),
    auth_tag = F.bytes("udpverbs.auth.tag", "Cluster key: MAC (GMAC tag)"),

    init_tag = F.uint32("udpverbs.init.tag", "Sender's tag", base.HEX),
    init_isn = F.uint32("udpverbs.init.isn", "Initial sequence number", base.DEC),
    init_max_payload = F.uint16("udpverbs.init.max_payload", "Largest link body accepted", base.DEC),
    init_rwnd = F.uint16("udpverbs.init.rwnd", "Initial receive window", base.DEC),
    init_incarnation = F.uint64("udpverbs.init.incarnation", "Incarnation", base.HEX),
    init_cookie = F.bytes("udpverbs.init.cookie", "Echoed cookie"),
    init_naddr = F.uint8("udpverbs.init.addresses", "Addresses", base.DEC),
    init_ipv4 = F.ipv4("udpverbs.init.ipv4", "Address"),
    init_ipv6 = F.ipv6("udpverbs.init.ipv6", "Address"),
    init_port = F.uint16("udpverbs.init.port", "Port", base.DEC),
    cookie_stamp = F.uint32("udpverbs.cookie.stamp_s", "Cookie time (s)", base.DEC),
    cookie_mac = F.bytes("udpverbs.cookie.mac", "Cookie MAC"),
    probe_id = F.uint32("udpverbs.probe.id", "Probe id", base.DEC),
    probe_padding = F.bytes("udpverbs.probe.padding", "Padding"),
    probe_size = F.uint32("udpverbs.probe.size", "Probe body received (bytes)", base.DEC),

    kind = F.uint8("udpverbs.env.kind", "Kind", base.DEC, KINDS),
    dst_qpn = F.uint24("udpverbs.env.dst_qpn", "Destination QPN", base.DEC),
    env_flags = F.uint8("udpverbs.env.flags", "Envelope flags", base.HEX),
    imm_follows = F.bool("udpverbs.env.flags.imm_follows", "Immediate Data follows", 8, nil, ENV_IMM_FOLLOWS),
    flow_ack_flag = F.bool("udpverbs.env.flags.flow_ack", "Modified ACK trailer", 8, nil, ENV_FLOW_ACK),
    src_qpn = F.uint24("udpverbs.env.src_qpn", "Source QPN", base.DEC),
    flow_ack_msn = F.uint32("udpverbs.env.flow_ack_msn", "Modified ACK: queue-0 MSNs below this placed", base.DEC),
    ddp_payload_len = F.uint32("udpverbs.ddp_payload_len", "DDP payload length", base.DEC),

    cm_type = F.uint8("udpverbs.cm.type", "CM type", base.DEC, CM_TYPES),
    cm_reserved = F.uint8("udpverbs.cm.reserved", "Reserved", base.HEX),
    cm_pd_len = F.uint16("udpverbs.cm.pd_len", "Private data length", base.DEC),
    cm_request_id = F.uint32("udpverbs.cm.request_id", "Request ID", base.DEC),
    cm_service_port = F.uint16("udpverbs.cm.service_port", "Service port", base.DEC),
    cm_ird = F.uint16("udpverbs.cm.ird", "IRD", base.DEC),
    cm_ord = F.uint16("udpverbs.cm.ord", "ORD", base.DEC),
    cm_qpn = F.uint32("udpverbs.cm.qpn", "QPN", base.DEC),
    cm_max_msg = F.uint32("udpverbs.cm.max_message_size", "Max message size", base.DEC),
    cm_reason = F.uint16("udpverbs.cm.reason", "Reject reason", base.DEC, CM_REASONS),
    cm_private = F.bytes("udpverbs.cm.private_data", "Private data"),

    flow_type = F.uint8("udpverbs.flow.type", "Flow type", base.DEC, FLOW_TYPES),
    flow_msn = F.uint32("udpverbs.flow.msn", "MSN", base.DEC),
    flow_backoff = F.uint32("udpverbs.flow.backoff_us", "Back-off (us)", base.DEC),

    lock_type = F.uint8("udpverbs.lock.type", "Lock message", base.DEC, LOCK_TYPES),
    lock_status = F.uint8("udpverbs.lock.status", "Status", base.DEC, LOCK_STATUS),
    lock_group = F.uint32("udpverbs.lock.group", "Group", base.HEX),
    lock_id = F.uint32("udpverbs.lock.lock_id", "Lock ID", base.DEC),
    lock_proc = F.uint32("udpverbs.lock.proc", "Rank", base.DEC),
    lock_seq = F.uint32("udpverbs.lock.seq", "Acquisition", base.DEC),
    lock_succ_proc = F.uint32("udpverbs.lock.succ_proc", "Successor rank", base.DEC),
    lock_succ_seq = F.uint32("udpverbs.lock.succ_seq", "Successor acquisition", base.DEC),

    barrier_type = F.uint8("udpverbs.barrier.type", "Barrier message", base.DEC, BARRIER_TYPES),
    barrier_algorithm = F.uint8("udpverbs.barrier.algorithm", "Algorithm", base.DEC, BARRIER_ALGORITHMS),
    barrier_arity = F.uint8("udpverbs.barrier.arity", "Arity", base.DEC),
    barrier_round = F.uint8("udpverbs.barrier.round", "Round", base.DEC),
    barrier_group = F.uint32("udpverbs.barrier.group", "Group", base.HEX),
    barrier_generation = F.uint32("udpverbs.barrier.generation", "Generation", base.DEC),
    barrier_sender = F.uint32("udpverbs.barrier.sender", "Sending daemon", base.DEC),

    group_type = F.uint8("udpverbs.group.type", "Group message", base.DEC, GROUP_TYPES),
    group_status = F.uint8("udpverbs.group.status", "Status", base.DEC, LEAVE_STATUS),
    group_group = F.uint32("udpverbs.group.group", "Group", base.HEX),
    group_rank = F.uint32("udpverbs.group.rank", "Rank", base.DEC),
    group_generation = F.uint32("udpverbs.group.generation", "Generation", base.DEC),
    message_reserved = F.uint16("udpverbs.message_reserved", "Reserved", base.HEX),
}
udpverbs.fields = f

local r = {
    tagged = F.bool("udpverbs_rdmap.tagged", "Tagged (T)", 8, nil, 0x80),
    last = F.bool("udpverbs_rdmap.last", "Last segment (L)", 8, nil, 0x40),
    dv = F.uint8("udpverbs_rdmap.dv", "DDP version", base.DEC, nil, 0x03),
    rv = F.uint8("udpverbs_rdmap.rv", "RDMAP version", base.DEC, nil, 0xC0),
    opcode = F.uint8("udpverbs_rdmap.opcode", "OpCode", base.DEC, OPCODES, 0x0F),
    stag = F.uint32("udpverbs_rdmap.stag", "STag", base.HEX),
    to = F.uint64("udpverbs_rdmap.to", "Tagged offset", base.HEX),
    inv_stag = F.uint32("udpverbs_rdmap.inv_stag", "Invalidate STag", base.HEX),
    qn = F.uint32("udpverbs_rdmap.qn", "Queue number", base.DEC, QUEUES),
    msn = F.uint32("udpverbs_rdmap.msn", "Message sequence number", base.DEC),
    mo = F.uint32("udpverbs_rdmap.mo", "Message offset", base.DEC),
    payload = F.bytes("udpverbs_rdmap.payload", "Payload"),

    rr_sink_stag = F.uint32("udpverbs_rdmap.rr.sink_stag", "Data Sink STag", base.HEX),
    rr_sink_to = F.uint64("udpverbs_rdmap.rr.sink_to", "Data Sink tagged offset", base.HEX),
    rr_size = F.uint32("udpverbs_rdmap.rr.size", "RDMA Read message size", base.DEC),
    rr_src_stag = F.uint32("udpverbs_rdmap.rr.src_stag", "Data Source STag", base.HEX),
    rr_src_to = F.uint64("udpverbs_rdmap.rr.src_to", "Data Source tagged offset", base.HEX),

    term_layer = F.uint32("udpverbs_rdmap.term.layer", "Layer", base.DEC, TERM_LAYERS, 0xF0000000),
    term_etype = F.uint32("udpverbs_rdmap.term.etype", "Error type", base.DEC, nil, 0x0F000000),
    term_ecode = F.uint32("udpverbs_rdmap.term.ecode", "Error code", base.HEX, nil, 0x00FF0000),
    term_m = F.bool("udpverbs_rdmap.term.m", "M: segment length valid", 32, nil, 0x8000),
    term_d = F.bool("udpverbs_rdmap.term.d", "D: DDP header copied", 32, nil, 0x4000),
    term_r = F.bool("udpverbs_rdmap.term.r", "R: RDMAP header copied", 32, nil, 0x2000),
    term_seglen = F.uint16("udpverbs_rdmap.term.ddp_seg_len", "DDP segment length", base.DEC),
    term_ddp = F.bytes("udpverbs_rdmap.term.ddp_header", "Terminated DDP header"),
    term_rdmap = F.bytes("udpverbs_rdmap.term.rdmap_header", "Terminated RDMAP header"),

    atomic_aop = F.uint32("udpverbs_rdmap.atomic.opcode", "Atomic operation", base.DEC, ATOMIC_OPS, 0x0000000F),
    atomic_req_id = F.uint32("udpverbs_rdmap.atomic.req_id", "Request identifier", base.DEC),
    atomic_stag = F.uint32("udpverbs_rdmap.atomic.stag", "Remote STag", base.HEX),
    atomic_to = F.uint64("udpverbs_rdmap.atomic.to", "Remote tagged offset", base.HEX),
    atomic_add_swap = F.uint64("udpverbs_rdmap.atomic.add_swap_data", "Add or swap data", base.HEX),
    atomic_add_swap_mask = F.uint64("udpverbs_rdmap.atomic.add_swap_mask", "Add or swap mask", base.HEX),
    atomic_compare = F.uint64("udpverbs_rdmap.atomic.compare_data", "Compare data", base.HEX),
    atomic_compare_mask = F.uint64("udpverbs_rdmap.atomic.compare_mask", "Compare mask", base.HEX),
    atomic_orig_req_id = F.uint32("udpverbs_rdmap.atomic.orig_req_id", "Original request identifier", base.DEC),
    atomic_orig_value = F.uint64("udpverbs_rdmap.atomic.orig_value", "Original remote data value", base.HEX),
    imm_data = F.uint64("udpverbs_rdmap.imm_data", "Immediate data", base.HEX),
}
rdmap.fields = r

local e_crc = ProtoExpert.new("udpverbs.crc.bad", "Bad CRC32c", expert.group.CHECKSUM, expert.severity.ERROR)
local e_malformed = ProtoExpert.new("udpverbs.malformed", "Malformed udpverbs message", expert.group.MALFORMED,
                                    expert.severity.ERROR)
udpverbs.experts = { e_crc, e_malformed }

udpverbs.prefs.ports = Pref.range("UDP ports", tostring(DEFAULT_PORT),
                                  "UDP ports of udpverbs daemons (udpverbsd --port)", 65535)
udpverbs.prefs.heuristic = Pref.bool("Find udpverbs on any UDP port", true,
                                     "Recognise link packets on other UDP ports by their header and CRC32c")
udpverbs.prefs.check_crc = Pref.bool("Verify every CRC32c", false,
                                     "Compute the CRC32c of every link packet (slow on large captures)")
udpverbs.prefs.use_iwarp = Pref.bool("Decode DDP/RDMAP with Wireshark's iWARP dissector", true,
                                     "Hand each DDP segment to iwarp_ddp_rdmap; off: decode it here")

-- ---------------------------------------------------------------------------
-- CRC32c (Castagnoli, reflected), as the crc32c package computes it
-- ---------------------------------------------------------------------------

local CRC_TABLE = {}
for i = 0, 255 do
    local c = i
    for _ = 1, 8 do
        if band(c, 1) == 1 then c = bxor(rshift(c, 1), 0x82F63B78) else c = rshift(c, 1) end
    end
    CRC_TABLE[i] = c
end

-- CRC32c of bytes i..j (1-based, inclusive) of the Lua string s.
local function crc32c(s, i, j)
    local crc = 0xFFFFFFFF
    local byte, T = string.byte, CRC_TABLE
    local k = i
    while k <= j do
        local e = math.min(k + 2047, j)
        for _, b in ipairs({ byte(s, k, e) }) do
            crc = bxor(T[band(bxor(crc, b), 0xFF)], rshift(crc, 8))
        end
        k = e + 1
    end
    return bxor(crc, 0xFFFFFFFF)
end

local function be32(s, i) -- big-endian u32 at 1-based index i of s
    local a, b, c, d = string.byte(s, i, i + 3)
    return ((a * 256 + b) * 256 + c) * 256 + d
end

-- Whether the link packet at 1-based [i, j] of s ends with its own CRC32c.
local function crc_ok(s, i, j)
    return crc32c(s, i, j - CRC_LEN) == be32(s, j - CRC_LEN + 1)
end

-- ---------------------------------------------------------------------------
-- Where the link packets of a datagram start (GSO runs)
-- ---------------------------------------------------------------------------

-- A link header could start at 0-based offset off of s (n bytes): version,
-- packet type, reserved byte and SACK count (packets of one run may be of
-- different types and connections: an INIT_ACK and an INIT, say).
local function header_at(s, off, n)
    if n - off < MIN_PACKET then return false end
    local v, p = string.byte(s, off + 1, off + 2)
    local nsack, reserved = string.byte(s, off + 27, off + 28)
    return v == LINK_VERSION and PTYPES[p] ~= nil and reserved == 0 and nsack <= MAX_SACK
end

-- How many bytes of cluster-key trailer follow the link packet at 1-based
-- [1, size] of s: 0 or AUTH_TRAILER_LEN, whichever leaves a packet ending in
-- its own CRC32c; nil when neither does.
local function trailer_of(s, size)
    if size >= MIN_PACKET and crc_ok(s, 1, size) then return 0 end
    if size >= MIN_PACKET + AUTH_TRAILER_LEN and crc_ok(s, 1, size - AUTH_TRAILER_LEN) then
        return AUTH_TRAILER_LEN
    end
    return nil
end

-- The size of the pieces of a GSO run held in s (each a link packet and its
-- trailer, if any), or n when s is one piece; and the trailer's length.
local function run_size(s, n)
    local from = MIN_PACKET + 1 -- a second packet starts at offset 32 or later
    while true do
        local at = string.find(s, VERSION_BYTE .. "[\1-\9]", from) -- the version, a packet type
        if at == nil then return n, trailer_of(s, n) end
        local size = at - 1
        local ok = true
        local off = size
        while ok and off < n do
            ok = header_at(s, off, n)
            off = off + size
        end
        -- a CRC on the first piece tells a real run from a look-alike in a payload
        if ok then
            local tail = trailer_of(s, size)
            if tail ~= nil then return size, tail end
        end
        from = at + 1
    end
end

-- ---------------------------------------------------------------------------
-- Messages in a DATA packet's body
-- ---------------------------------------------------------------------------

local function add_fields(tree, tvb, off, list)
    for _, it in ipairs(list) do
        tree:add(it[1], tvb(off, it[2]))
        off = off + it[2]
    end
    return off
end

local function name_of(map, v)
    return map[v] or ("unknown " .. v)
end

local function dissect_cm(tvb, tree)
    local n = tvb:len()
    if n < 8 then
        tree:add_proto_expert_info(e_malformed, "CM message of " .. n .. " bytes")
        return "CM (truncated)"
    end
    local t = tree:add(tvb(), "Connection management")
    local ctype = tvb(0, 1):uint()
    local off = add_fields(t, tvb, 0, { { f.cm_type, 1 }, { f.cm_reserved, 1 }, { f.cm_pd_len, 2 },
                                        { f.cm_request_id, 4 } })
    local fixed = ({
        [1] = { { f.cm_service_port, 2 }, { f.cm_ird, 2 }, { f.cm_ord, 2 }, { f.message_reserved, 2 },
                { f.cm_qpn, 4 }, { f.cm_max_msg, 4 } },
        [2] = { { f.cm_qpn, 4 }, { f.cm_ird, 2 }, { f.cm_ord, 2 }, { f.cm_max_msg, 4 } },
        [3] = { { f.cm_reason, 2 }, { f.message_reserved, 2 } },
        [4] = { { f.cm_qpn, 4 } },
    })[ctype]
    local need = 0
    for _, it in ipairs(fixed or {}) do need = need + it[2] end
    if fixed == nil or n < off + need then
        t:add_proto_expert_info(e_malformed, "CM type " .. ctype .. ", " .. n .. " bytes")
        return "CM " .. name_of(CM_TYPES, ctype)
    end
    off = add_fields(t, tvb, off, fixed)
    if n > off then t:add(f.cm_private, tvb(off)) end
    return "CM " .. name_of(CM_TYPES, ctype) .. " id " .. tvb(4, 4):uint()
end

-- The fixed-size group and flow messages: {name, length, fields, type table}.
local FIXED_MESSAGES = {
    [K_FLOW] = { "Modified ACK/NACK", 12, { { f.flow_type, 1 }, { f.cm_reserved, 1 }, { f.message_reserved, 2 },
                                            { f.flow_msn, 4 }, { f.flow_backoff, 4 } }, FLOW_TYPES, "FLOW" },
    [K_LOCK] = { "Queue lock", 28, { { f.lock_type, 1 }, { f.lock_status, 1 }, { f.message_reserved, 2 },
                                     { f.lock_group, 4 }, { f.lock_id, 4 }, { f.lock_proc, 4 }, { f.lock_seq, 4 },
                                     { f.lock_succ_proc, 4 }, { f.lock_succ_seq, 4 } }, LOCK_TYPES, "LOCK" },
    [K_BARRIER] = { "Barrier", 16, { { f.barrier_type, 1 }, { f.barrier_algorithm, 1 }, { f.barrier_arity, 1 },
                                     { f.barrier_round, 1 }, { f.barrier_group, 4 }, { f.barrier_generation, 4 },
                                     { f.barrier_sender, 4 } }, BARRIER_TYPES, "BARRIER" },
    [K_GROUP] = { "Process group", 16, { { f.group_type, 1 }, { f.group_status, 1 }, { f.message_reserved, 2 },
                                         { f.group_group, 4 }, { f.group_rank, 4 }, { f.group_generation, 4 } },
                  GROUP_TYPES, "GROUP" },
}

local function dissect_fixed(kind, tvb, tree)
    local m = FIXED_MESSAGES[kind]
    local t = tree:add(tvb(), m[1])
    if tvb:len() ~= m[2] then
        t:add_proto_expert_info(e_malformed, m[1] .. " of " .. tvb:len() .. " bytes, not " .. m[2])
        return m[5] .. " (malformed)"
    end
    add_fields(t, tvb, 0, m[3])
    local summary = m[5] .. " " .. name_of(m[4], tvb(0, 1):uint())
    if kind == K_FLOW then summary = summary .. " MSN " .. tvb(4, 4):uint() end
    return summary
end

-- ---------------------------------------------------------------------------
-- DDP segments carrying RDMAP
-- ---------------------------------------------------------------------------

-- The DDP header of a segment: tagged, last, opcode and the buffer-model fields.
local function ddp_header(tvb)
    local n = tvb:len()
    if n < 14 then return nil end
    local ctrl, rctl = tvb(0, 1):uint(), tvb(1, 1):uint()
    local h = { tagged = band(ctrl, 0x80) ~= 0, last = band(ctrl, 0x40) ~= 0, op = band(rctl, 0x0F) }
    if h.tagged then
        h.len, h.stag, h.to = 14, tvb(2, 4):uint(), tvb(6, 8):uint64()
    else
        if n < 18 then return nil end
        h.len, h.inv, h.qn, h.msn, h.mo = 18, tvb(2, 4):uint(), tvb(6, 4):uint(), tvb(10, 4):uint(),
            tvb(14, 4):uint()
    end
    return h
end

local function add_ddp_header(t, tvb, h)
    t:add(r.tagged, tvb(0, 1))
    t:add(r.last, tvb(0, 1))
    t:add(r.dv, tvb(0, 1))
    t:add(r.rv, tvb(1, 1))
    t:add(r.opcode, tvb(1, 1))
    if h.tagged then
        add_fields(t, tvb, 2, { { r.stag, 4 }, { r.to, 8 } })
    else
        add_fields(t, tvb, 2, { { r.inv_stag, 4 }, { r.qn, 4 }, { r.msn, 4 }, { r.mo, 4 } })
    end
end

local function add_terminate(t, tvb)
    if tvb:len() < 4 then
        t:add_proto_expert_info(e_malformed, "Terminate of " .. tvb:len() .. " bytes")
        return
    end
    local word = tvb(0, 4):uint()
    local layer, etype, ecode = rshift(word, 28), band(rshift(word, 24), 0x0F), band(rshift(word, 16), 0xFF)
    t:add(r.term_layer, tvb(0, 4))
    t:add(r.term_etype, tvb(0, 4)):append_text(" (" .. name_of(TERM_ETYPES[layer] or {}, etype) .. ")")
    local codes = (TERM_ECODES[layer] or {})[etype] or {}
    t:add(r.term_ecode, tvb(0, 4)):append_text(" (" .. name_of(codes, ecode) .. ")")
    for _, fld in ipairs({ r.term_m, r.term_d, r.term_r }) do
        t:add(fld, tvb(0, 4))
    end
    local off = 4
    if band(word, 0x4000) ~= 0 and tvb:len() >= off + 3 then
        t:add(r.term_seglen, tvb(off, 2))
        off = off + 2
        local hlen = band(tvb(off, 1):uint(), 0x80) ~= 0 and 14 or 18
        if tvb:len() >= off + hlen then
            local sub = tvb(off, hlen):tvb()
            local ht = t:add(r.term_ddp, tvb(off, hlen))
            local h = ddp_header(sub)
            if h then add_ddp_header(ht, sub, h) end
            off = off + hlen
        end
    end
    if band(word, 0x2000) ~= 0 and tvb:len() >= off + 28 then
        t:add(r.term_rdmap, tvb(off, 28))
    end
end

-- The RDMAP header a single-segment message carries as its DDP payload.
local function add_body(t, op, body)
    local n = body:len()
    if op == OP_READ_REQUEST and n == 28 then
        add_fields(t, body, 0, { { r.rr_sink_stag, 4 }, { r.rr_sink_to, 8 }, { r.rr_size, 4 }, { r.rr_src_stag, 4 },
                                 { r.rr_src_to, 8 } })
    elseif op == OP_TERMINATE then
        add_terminate(t, body)
    elseif (op == OP_IMM or op == OP_IMM_SE) and n == 8 then
        t:add(r.imm_data, body(0, 8))
    elseif op == OP_ATOMIC_REQ and n == 52 then
        add_fields(t, body, 0, { { r.atomic_aop, 4 }, { r.atomic_req_id, 4 }, { r.atomic_stag, 4 }, { r.atomic_to, 8 },
                                 { r.atomic_add_swap, 8 }, { r.atomic_add_swap_mask, 8 }, { r.atomic_compare, 8 },
                                 { r.atomic_compare_mask, 8 } })
    elseif op == OP_ATOMIC_RESP and n == 12 then
        add_fields(t, body, 0, { { r.atomic_orig_req_id, 4 }, { r.atomic_orig_value, 8 } })
    elseif n > 0 then
        t:add(r.payload, body())
    end
end

local function ddp_summary(h, tvb)
    local s = name_of(OPCODES, h.op)
    if h.tagged then
        s = s .. string.format(" STag 0x%08x TO 0x%s, %d B", h.stag, h.to:tohex():gsub("^0+(.)", "%1"),
                               tvb:len() - h.len)
    else
        s = s .. string.format(" QN %d MSN %d MO %d", h.qn, h.msn, h.mo)
        if h.inv ~= 0 then s = s .. string.format(" inv 0x%08x", h.inv) end
        if h.op == OP_ATOMIC_REQ and tvb:len() >= h.len + 4 then
            s = s .. " " .. name_of(ATOMIC_OPS, band(tvb(h.len, 4):uint(), 0x0F))
        end
    end
    if not h.last then s = s .. " [more]" end
    return s
end

local iwarp = nil
local function iwarp_dissector()
    if iwarp == nil then
        local ok, d = pcall(Dissector.get, "iwarp_ddp_rdmap")
        iwarp = ok and d or false
    end
    return iwarp
end

-- Wireshark's iWARP dissector decodes opcodes 0000b-0111b and the atomics
-- (not Swap); RFC 7306's Immediate Data and the atomics in full are ours,
-- and so is the Terminate, whose copied DDP header it takes for a tagged
-- one whenever the error type's value is 1.
local OURS_ALONGSIDE_IWARP = { [OP_TERMINATE] = true, [OP_IMM] = true, [OP_IMM_SE] = true, [OP_ATOMIC_REQ] = true,
                               [OP_ATOMIC_RESP] = true }

local function dissect_ddp(seg, pinfo, root, tree)
    local h = ddp_header(seg)
    if h == nil then
        tree:add_proto_expert_info(e_malformed, "DDP segment of " .. seg:len() .. " bytes")
        return "DDP (truncated)"
    end
    tree:add(f.ddp_payload_len, seg:len() - h.len):set_generated()
    local body = seg(h.len):tvb()
    local d = udpverbs.prefs.use_iwarp and iwarp_dissector()
    if d then
        local ok, err = pcall(Dissector.call, d, seg, pinfo, root)
        if not ok then tree:add_proto_expert_info(e_malformed, "iwarp_ddp_rdmap: " .. tostring(err)) end
        if OURS_ALONGSIDE_IWARP[h.op] then
            add_body(root:add(rdmap, seg(h.len), "RDMAP " .. name_of(OPCODES, h.op)), h.op, body)
        end
    else
        local t = root:add(rdmap, seg(), "RDMAP " .. name_of(OPCODES, h.op))
        add_ddp_header(t, seg, h)
        add_body(t, h.op, body)
    end
    return ddp_summary(h, seg)
end

-- One message: the envelope and what its kind says follows.
local function dissect_message(msg, pinfo, root, tree)
    local n = msg:len()
    if n < ENVELOPE_LEN then
        tree:add_proto_expert_info(e_malformed, "message of " .. n .. " bytes, shorter than the envelope")
        return "(truncated)"
    end
    local kind, flags = msg(0, 1):uint(), msg(4, 1):uint()
    local env = tree:add(msg(0, ENVELOPE_LEN), "Envelope: " .. name_of(KINDS, kind))
    env:add(f.kind, msg(0, 1))
    env:add(f.dst_qpn, msg(1, 3))
    local ft = env:add(f.env_flags, msg(4, 1))
    ft:add(f.imm_follows, msg(4, 1))
    ft:add(f.flow_ack_flag, msg(4, 1))
    env:add(f.src_qpn, msg(5, 3))
    local stop = n
    if band(flags, ENV_FLOW_ACK) ~= 0 and n >= ENVELOPE_LEN + FLOW_ACK_LEN then
        stop = n - FLOW_ACK_LEN
        env:add(f.flow_ack_msn, msg(stop, FLOW_ACK_LEN))
    end
    local qps = string.format("QP %d>%d ", msg(5, 3):uint(), msg(1, 3):uint())
    local rest = nil
    if stop > ENVELOPE_LEN then rest = msg(ENVELOPE_LEN, stop - ENVELOPE_LEN):tvb() end
    local summary
    if kind == K_DDP and rest then
        summary = dissect_ddp(rest, pinfo, root, tree)
        if band(flags, ENV_IMM_FOLLOWS) ~= 0 then summary = summary .. " (Immediate Data follows)" end
    elseif kind == K_CM and rest then
        summary = dissect_cm(rest, tree)
    elseif FIXED_MESSAGES[kind] and rest then
        summary = dissect_fixed(kind, rest, tree)
    else
        tree:add_proto_expert_info(e_malformed, "envelope kind " .. kind .. " with " .. (stop - 8) .. " bytes")
        summary = name_of(KINDS, kind)
    end
    if band(flags, ENV_FLOW_ACK) ~= 0 then summary = summary .. string.format(", ACK <%d", msg(stop, 4):uint()) end
    return qps .. summary
end

-- ---------------------------------------------------------------------------
-- Link packets
-- ---------------------------------------------------------------------------

-- The body of a link packet: [at, at + n) of the packet p.
local function dissect_link_body(ptype, p, at, n, pinfo, root, t)
    if ptype == P_DATA then
        if n == 0 then
            t:add_proto_expert_info(e_malformed, "DATA without a message")
            return ""
        end
        return dissect_message(p(at, n):tvb(), pinfo, root, t)
    elseif (ptype == P_INIT or ptype == P_INIT_ACK) and n >= INIT_LEN then
        local off = add_fields(t, p, at, { { f.init_tag, 4 }, { f.init_isn, 4 }, { f.init_max_payload, 2 },
                                           { f.init_rwnd, 2 }, { f.init_incarnation, 8 }, { f.init_naddr, 1 } })
        -- the sender's addresses (family 4 or 6, address, port), then the cookie if any
        local naddr = p(at + INIT_LEN - 1, 1):uint()
        for _ = 1, naddr do
            local fam = off < at + n and p(off, 1):uint() or 0
            local len = fam == 4 and 4 or (fam == 6 and 16 or 0)
            if len == 0 or off + 3 + len > at + n then break end
            t:add(fam == 4 and f.init_ipv4 or f.init_ipv6, p(off + 1, len))
            t:add(f.init_port, p(off + 1 + len, 2))
            off = off + 3 + len
        end
        local cookie = at + n - off == COOKIE_LEN
        if cookie then t:add(f.init_cookie, p(off, COOKIE_LEN)) end
        return string.format("tag 0x%08x isn %d%s%s", p(at, 4):uint(), p(at + 4, 4):uint(),
                             naddr > 0 and string.format(", %d addresses", naddr) or "",
                             cookie and " with cookie" or "")
    elseif ptype == P_COOKIE and n == COOKIE_LEN then
        add_fields(t, p, at, { { f.cookie_stamp, 4 }, { f.cookie_mac, COOKIE_LEN - 4 } })
    elseif ptype == P_PROBE and n >= 4 then
        t:add(f.probe_id, p(at, 4))
        if n > 4 then t:add(f.probe_padding, p(at + 4, n - 4)) end
        return string.format("probe %d, %d-byte body", p(at, 4):uint(), n)
    elseif ptype == P_PROBE_ACK and n == 8 then
        add_fields(t, p, at, { { f.probe_id, 4 }, { f.probe_size, 4 } })
        return string.format("probe %d carried, %d-byte body", p(at, 4):uint(), p(at + 4, 4):uint())
    elseif n > 0 then
        t:add(f.body, p(at, n))
        t:add_proto_expert_info(e_malformed, name_of(PTYPES, ptype) .. " with a body of " .. n .. " bytes")
    end
    return ""
end

-- One link packet at [off, off + len) of the datagram; returns its summary and tree.
local function dissect_link_packet(tvb, raw, off, len, pinfo, root, check_crc)
    local p = tvb(off, len):tvb()
    local ptype, nsack = p(1, 1):uint(), p(26, 1):uint()
    local t = root:add(udpverbs, p(), "udpverbs link packet, " .. name_of(PTYPES, ptype))
    t:add(f.version, p(0, 1))
    t:add(f.ptype, p(1, 1))
    local ft = t:add(f.flags, p(2, 1))
    ft:add(f.ack_now, p(2, 1))
    ft:add(f.retransmission, p(2, 1))
    add_fields(t, p, 3, { { f.path_id, 1 }, { f.conn_tag, 4 }, { f.seq, 4 }, { f.ack, 4 }, { f.ts_us, 4 },
                                { f.ts_echo_us, 4 }, { f.rwnd, 2 }, { f.sack_count, 1 }, { f.reserved, 1 } })
    local at = HEADER_LEN
    if nsack > MAX_SACK or at + 8 * nsack + CRC_LEN > len then
        t:add_proto_expert_info(e_malformed, nsack .. " SACK blocks")
        nsack = 0
    end
    for _ = 1, nsack do
        local st = t:add(p(at, 8), string.format("SACK %d-%d", p(at, 4):uint(), p(at + 4, 4):uint()))
        st:add(f.sack_start, p(at, 4))
        st:add(f.sack_end, p(at + 4, 4))
        at = at + 8
    end
    local crc_at = len - CRC_LEN
    local summary = dissect_link_body(ptype, p, at, crc_at - at, pinfo, root, t)
    t:add(f.crc, p(crc_at, CRC_LEN))
    if check_crc then
        local good = crc_ok(raw, off + 1, off + len)
        t:add(f.crc_status, p(crc_at, CRC_LEN), good and 1 or 0)
        if not good then t:add_proto_expert_info(e_crc) end
    else
        t:add(f.crc_status, p(crc_at, CRC_LEN), 2)
    end
    local head = string.format("%s seq %d ack %d", name_of(PTYPES, ptype), p(8, 4):uint(), p(12, 4):uint())
    if nsack > 0 then head = head .. " SACK " .. nsack end
    if summary ~= "" then head = head .. ": " .. summary end
    return head, t
end

-- A datagram that starts like a link packet: version, type, reserved byte, SACK count.
local function looks_like_link(tvb)
    local n = tvb:len()
    if n < MIN_PACKET or tvb(0, 1):uint() ~= LINK_VERSION or PTYPES[tvb(1, 1):uint()] == nil then return false end
    local nsack = tvb(26, 1):uint()
    return tvb(27, 1):uint() == 0 and nsack <= MAX_SACK and HEADER_LEN + 8 * nsack + CRC_LEN <= n
end

local function dissect(tvb, pinfo, root, from_heuristic)
    if not looks_like_link(tvb) then return 0 end
    local raw = tvb:raw()
    local n = tvb:len()
    local size, tail = run_size(raw, n)
    if from_heuristic and size == n and tail == nil then return 0 end
    tail = tail or 0
    pinfo.cols.protocol:set("udpverbs")
    local summaries, count, first = {}, 0, nil
    local check = udpverbs.prefs.check_crc
    local off = 0
    while off < n do
        local len = math.min(size, n - off)
        count = count + 1
        local summary, t = dissect_link_packet(tvb, raw, off, len - tail, pinfo, root, check)
        if tail > 0 then
            local at = off + len - tail
            local tt = t:add(tvb(at, tail), "Cluster key trailer")
            tt:add(f.auth_salt, tvb(at, 4))
            tt:add(f.auth_pn, tvb(at + 4, 8))
            tt:add(f.auth_tag, tvb(at + 12, tail - 12))
        end
        summaries[count] = summary
        first = first or t
        off = off + len
    end
    local info = summaries[1]
    if count > 1 then
        first:add(f.gso, count):set_generated()
        info = string.format("%d link packets: %s; ...; %s", count, summaries[1], summaries[count])
        if count == 2 then info = string.format("2 link packets: %s; %s", summaries[1], summaries[2]) end
    end
    pinfo.cols.protocol:set("udpverbs")
    pinfo.cols.info:set(info)
    return n
end

function udpverbs.dissector(tvb, pinfo, tree)
    return dissect(tvb, pinfo, tree, false)
end

local function heuristic(tvb, pinfo, tree)
    if not udpverbs.prefs.heuristic or not looks_like_link(tvb) then return false end
    if dissect(tvb, pinfo, tree, true) == 0 then return false end
    pinfo.conversation = udpverbs -- the rest of this conversation goes straight to us
    return true
end

local udp_port = DissectorTable.get("udp.port")
local registered = nil

function udpverbs.prefs_changed()
    if registered ~= udpverbs.prefs.ports then
        udp_port:remove_all(udpverbs)
        udp_port:add(udpverbs.prefs.ports, udpverbs)
        registered = udpverbs.prefs.ports
    end
end

udp_port:add(DEFAULT_PORT, udpverbs)
registered = tostring(DEFAULT_PORT)
udpverbs:register_heuristic("udp", heuristic)
