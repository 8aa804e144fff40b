//! nftables messages written by hand (docs/network.md "Enforcement"): the batch the table's
//! changes go out in, and the few objects rustables cannot express: sets with concatenated
//! and interval keys, verdict maps, elements with an end key, a timeout or a verdict, and
//! expressions that address the kernel's 32-bit registers (a concatenated key is built in
//! consecutive 4-byte registers, which rustables' `Register` cannot name).
//!
//! The wire format is netlink's: a header, a `nfgenmsg`, then attributes (type, length,
//! payload padded to 4 bytes), nested where the kernel nests them; integers are big-endian,
//! as nf_tables wants. The numbers are those of `linux/netfilter/nf_tables.h`.

/// `NFNL_SUBSYS_NFTABLES`.
const SUBSYS: u16 = 10;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_CREATE: u16 = 0x400;
const NLA_F_NESTED: u16 = 0x8000;
/// `NFPROTO_INET`: the family of our table.
const FAMILY_INET: u8 = 1;

/// Message types (`enum nf_tables_msg_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    NewTable = 0,
    NewChain = 3,
    NewRule = 6,
    NewSet = 9,
    NewSetElem = 12,
    DelSetElem = 14,
    /// Deletes a rule, or flushes its chain without a handle; no error if the chain is
    /// missing.
    DestroyRule = 28,
    DestroyChain = 27,
    DestroySet = 29,
    /// Deletes elements; no error for one that is missing.
    DestroySetElem = 30,
}

/// Netfilter hooks (`enum nf_inet_hooks`).
pub const HOOK_PREROUTING: u32 = 0;
pub const HOOK_INPUT: u32 = 1;
pub const HOOK_FORWARD: u32 = 2;
pub const HOOK_OUTPUT: u32 = 3;
pub const HOOK_POSTROUTING: u32 = 4;

/// Verdict codes (`NF_DROP`, `NF_ACCEPT`, `NFT_JUMP`).
pub const NF_DROP: i32 = 0;
pub const NF_ACCEPT: i32 = 1;
pub const NFT_JUMP: i32 = -3;
/// `NFT_DATA_VERDICT`: a map whose values are verdicts.
const NFT_DATA_VERDICT: u32 = 0xffff_ff00;

/// Set flags.
pub const SET_INTERVAL: u32 = 0x4;
pub const SET_MAP: u32 = 0x8;
pub const SET_TIMEOUT: u32 = 0x10;
pub const SET_CONCAT: u32 = 0x80;

/// Registers: the verdict register, and the first 32-bit one (`NFT_REG32_00`); a value of
/// 16 bytes (an interface name) fills four of them.
pub const REG_VERDICT: u32 = 0;
pub const REG32: u32 = 8;

/// `enum nft_meta_keys`.
pub const META_IIFNAME: u32 = 6;
pub const META_OIFNAME: u32 = 7;
pub const META_NFPROTO: u32 = 15;
pub const META_L4PROTO: u32 = 16;

/// Payload bases.
pub const BASE_NETWORK: u32 = 1;
pub const BASE_TRANSPORT: u32 = 2;

/// `enum nft_cmp_ops`.
pub const CMP_EQ: u32 = 0;
pub const CMP_NEQ: u32 = 1;

/// The data types `nft` shows a set's key as (it composes a concatenation's 6 bits per
/// field); the kernel only stores them.
pub const TYPE_IPV4: u32 = 7;
pub const TYPE_INET_PROTO: u32 = 12;
pub const TYPE_INET_SERVICE: u32 = 13;
pub const TYPE_IFNAME: u32 = 41;

/// A concatenation's type as `nft` composes it.
pub fn concat_type(fields: &[u32]) -> u32 {
    fields.iter().fold(0, |acc, t| (acc << 6) | t)
}

/// Attributes under construction: a buffer whose nests are closed in order.
#[derive(Debug, Default, Clone)]
pub struct Attrs {
    buf: Vec<u8>,
    open: Vec<usize>,
}

impl Attrs {
    fn header(&mut self, kind: u16, len: usize) {
        // Attribute lengths are u16; every attribute we write is far smaller (the largest,
        // an element list, is split by the caller long before).
        self.buf
            .extend_from_slice(&(u16::try_from(len).unwrap_or(u16::MAX)).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
    }
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
    /// An attribute holding `data` as is.
    pub fn bytes(&mut self, kind: u16, data: &[u8]) -> &mut Self {
        self.header(kind, 4 + data.len());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }
    /// A NUL-terminated string.
    pub fn str(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.bytes(kind, &v)
    }
    /// A big-endian u32.
    pub fn u32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.bytes(kind, &v.to_be_bytes())
    }
    /// A big-endian u64.
    pub fn u64(&mut self, kind: u16, v: u64) -> &mut Self {
        self.bytes(kind, &v.to_be_bytes())
    }
    /// Opens a nested attribute; [`Attrs::end`] closes it.
    pub fn begin(&mut self, kind: u16) -> &mut Self {
        self.open.push(self.buf.len());
        self.header(kind | NLA_F_NESTED, 0);
        self
    }
    /// Closes the innermost nested attribute.
    pub fn end(&mut self) -> &mut Self {
        if let Some(at) = self.open.pop() {
            let len = u16::try_from(self.buf.len() - at).unwrap_or(u16::MAX);
            if let Some(h) = self.buf.get_mut(at..at + 2) {
                h.copy_from_slice(&len.to_ne_bytes());
            }
        }
        self
    }
    /// `nft_data` holding a value.
    pub fn value(&mut self, kind: u16, data: &[u8]) -> &mut Self {
        self.begin(kind).bytes(1, data).end()
    }
    /// `nft_data` holding a verdict (`NFTA_DATA_VERDICT`), with its chain for a jump.
    pub fn verdict(&mut self, kind: u16, code: i32, chain: Option<&str>) -> &mut Self {
        self.begin(kind).begin(2).u32(1, code as u32);
        if let Some(c) = chain {
            self.str(2, c);
        }
        self.end().end()
    }
    fn into_bytes(self) -> Vec<u8> {
        self.buf
    }
}

/// One expression of a rule.
#[derive(Debug, Clone)]
pub struct Expr {
    name: &'static str,
    data: Attrs,
}

impl Expr {
    fn new(name: &'static str) -> Expr {
        Expr {
            name,
            data: Attrs::default(),
        }
    }
    /// `meta <key>` into `dreg`.
    pub fn meta(key: u32, dreg: u32) -> Expr {
        let mut e = Expr::new("meta");
        e.data.u32(1, dreg).u32(2, key);
        e
    }
    /// `len` bytes at `offset` of header `base` into `dreg` (zero-padded to 4 bytes).
    pub fn payload(base: u32, offset: u32, len: u32, dreg: u32) -> Expr {
        let mut e = Expr::new("payload");
        e.data.u32(1, dreg).u32(2, base).u32(3, offset).u32(4, len);
        e
    }
    /// Compares `sreg` with `data` (a prefix of the register when shorter).
    pub fn cmp(sreg: u32, op: u32, data: &[u8]) -> Expr {
        let mut e = Expr::new("cmp");
        e.data.u32(1, sreg).u32(2, op).value(3, data);
        e
    }
    /// `dreg = (sreg & mask) ^ xor` over `mask.len()` bytes.
    pub fn bitwise(sreg: u32, dreg: u32, mask: &[u8], xor: &[u8]) -> Expr {
        let mut e = Expr::new("bitwise");
        e.data
            .u32(1, sreg)
            .u32(2, dreg)
            .u32(3, mask.len() as u32)
            .value(4, mask)
            .value(5, xor);
        e
    }
    /// Whether the key in `sreg` is in set `set`; with `dreg` [`REG_VERDICT`] on a verdict
    /// map, the element's verdict applies.
    pub fn lookup(set: &str, sreg: u32, dreg: Option<u32>) -> Expr {
        let mut e = Expr::new("lookup");
        e.data.str(1, set).u32(2, sreg);
        if let Some(d) = dreg {
            e.data.u32(3, d);
        }
        e
    }
    /// `ct state` into `dreg` (a 4-byte mask of `NF_CT_STATE_*` bits, host order).
    pub fn ct_state(dreg: u32) -> Expr {
        let mut e = Expr::new("ct");
        e.data.u32(1, dreg).u32(2, 0);
        e
    }
    /// A verdict, with its chain for a jump.
    pub fn verdict(code: i32, chain: Option<&str>) -> Expr {
        let mut e = Expr::new("immediate");
        e.data.u32(1, REG_VERDICT).verdict(2, code, chain);
        e
    }
    /// `data` into `dreg`.
    pub fn immediate(dreg: u32, data: &[u8]) -> Expr {
        let mut e = Expr::new("immediate");
        e.data.u32(1, dreg).value(2, data);
        e
    }
    /// Destination NAT of an IPv4 packet to the address in `addr_reg` and the port in
    /// `port_reg`.
    pub fn dnat_ipv4(addr_reg: u32, port_reg: u32) -> Expr {
        let mut e = Expr::new("nat");
        e.data
            .u32(1, 1) // NFT_NAT_DNAT
            .u32(2, u32::from(libc::NFPROTO_IPV4 as u8))
            .u32(3, addr_reg)
            .u32(5, port_reg);
        e
    }
    /// Source NAT to the outgoing interface's address.
    pub fn masquerade() -> Expr {
        Expr::new("masq")
    }
}

/// One set element: its key (and end key, for an interval of a concatenation), a timeout in
/// ms, a verdict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Elem {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
    /// A jump to this chain (elements of a verdict map).
    pub jump: Option<String>,
    /// `NFT_SET_ELEM_INTERVAL_END`: in a set of single-field intervals, the first key past
    /// an interval.
    pub interval_end: bool,
}

impl Elem {
    /// An element that is just `key`.
    pub fn key(key: Vec<u8>) -> Elem {
        Elem {
            key,
            ..Elem::default()
        }
    }
}

/// What a new set is: key length and flags, the field lengths of a concatenation, whether it
/// maps to verdicts, its default timeout.
#[derive(Debug, Clone, Default)]
pub struct SetSpec {
    pub key_type: u32,
    pub key_len: u32,
    pub flags: u32,
    /// The lengths of the concatenated fields (each padded to 4 bytes in the key).
    pub fields: Vec<u32>,
    pub verdict_map: bool,
    pub timeout_ms: Option<u64>,
    /// For `nft` only: how to show the set (`NFTA_SET_USERDATA`, libnftnl's TLVs).
    pub userdata: Option<Vec<u8>>,
}

/// The user data telling `nft` that a set's key is in host byte order (an interface name),
/// without which it shows such keys reversed.
pub fn host_order_key_userdata() -> Vec<u8> {
    // NFTNL_UDATA_SET_KEYBYTEORDER (0), 4 bytes: BYTEORDER_HOST_ENDIAN (1).
    let mut u = vec![0, 4];
    u.extend_from_slice(&1u32.to_ne_bytes());
    u
}

/// An nftables batch (one kernel transaction) of table `table`, family inet.
#[derive(Debug)]
pub struct Batch {
    table: String,
    buf: Vec<u8>,
    seq: u32,
    set_id: u32,
}

impl Batch {
    /// An empty batch (its begin marker) for `table`.
    pub fn new(table: &str) -> Batch {
        let mut b = Batch {
            table: table.to_string(),
            buf: Vec::new(),
            seq: 0,
            set_id: 0,
        };
        // The begin marker names the subsystem in res_id.
        b.message(0x10, NLM_F_REQUEST, 0, SUBSYS, Attrs::default());
        b
    }

    fn message(&mut self, kind: u16, flags: u16, family: u8, res_id: u16, attrs: Attrs) {
        let body = attrs.into_bytes();
        let len = 16 + 4 + body.len();
        self.buf.extend_from_slice(&(len as u32).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&self.seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.push(family);
        self.buf.push(0); // NFNETLINK_V0
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        self.buf.extend_from_slice(&body);
        self.seq += 1;
    }

    fn push(&mut self, op: Op, flags: u16, attrs: Attrs) {
        self.message(
            (SUBSYS << 8) | op as u16,
            NLM_F_REQUEST | flags,
            FAMILY_INET,
            0,
            attrs,
        );
    }

    /// Adds the table if missing.
    pub fn add_table(&mut self) {
        let mut a = Attrs::default();
        a.str(1, &self.table);
        self.push(Op::NewTable, NLM_F_CREATE, a);
    }

    /// Adds regular chain `name` if missing.
    pub fn add_chain(&mut self, name: &str) {
        let mut a = Attrs::default();
        a.str(1, &self.table).str(3, name);
        self.push(Op::NewChain, NLM_F_CREATE, a);
    }

    /// Adds base chain `name` (`kind` "filter" or "nat") on `hook` at `priority`, policy
    /// accept, if missing.
    pub fn add_base_chain(&mut self, name: &str, kind: &str, hook: u32, priority: i32) {
        let mut a = Attrs::default();
        a.str(1, &self.table).str(3, name);
        a.begin(4).u32(1, hook).u32(2, priority as u32).end();
        a.u32(5, NF_ACCEPT as u32).str(7, kind);
        self.push(Op::NewChain, NLM_F_CREATE, a);
    }

    /// Deletes every rule of chain `name` (nothing if it is missing).
    pub fn flush_chain(&mut self, name: &str) {
        let mut a = Attrs::default();
        a.str(1, &self.table).str(2, name);
        self.push(Op::DestroyRule, 0, a);
    }

    /// Deletes chain `name` with its rules (nothing if it is missing). Nothing may refer to
    /// it by the end of the batch.
    pub fn destroy_chain(&mut self, name: &str) {
        self.flush_chain(name);
        let mut a = Attrs::default();
        a.str(1, &self.table).str(3, name);
        self.push(Op::DestroyChain, 0, a);
    }

    /// Appends a rule of `exprs` to `chain`, with `userdata`.
    pub fn add_rule(&mut self, chain: &str, exprs: &[Expr], userdata: Option<&[u8]>) {
        let mut a = Attrs::default();
        a.str(1, &self.table).str(2, chain);
        a.begin(4);
        for e in exprs {
            a.begin(1).str(1, e.name);
            a.begin(2);
            a.buf.extend_from_slice(&e.data.buf);
            a.end().end();
        }
        a.end();
        if let Some(u) = userdata {
            a.bytes(7, u);
        }
        self.push(Op::NewRule, NLM_F_CREATE | 0x800, a); // NLM_F_APPEND
    }

    /// Adds set `name` if missing (one already there keeps its elements; it must be of the
    /// same shape, or the kernel refuses the batch).
    pub fn add_set(&mut self, name: &str, spec: &SetSpec) {
        self.set_id += 1;
        let mut a = Attrs::default();
        let flags = spec.flags | if spec.verdict_map { SET_MAP } else { 0 };
        a.str(1, &self.table)
            .str(2, name)
            .u32(3, flags)
            .u32(4, spec.key_type)
            .u32(5, spec.key_len);
        if spec.verdict_map {
            a.u32(6, NFT_DATA_VERDICT);
        }
        if !spec.fields.is_empty() {
            a.begin(9).begin(2);
            for f in &spec.fields {
                a.begin(1).u32(1, *f).end();
            }
            a.end().end();
        }
        a.u32(10, self.set_id);
        if let Some(t) = spec.timeout_ms {
            a.u64(11, t);
        }
        if let Some(u) = &spec.userdata {
            a.bytes(13, u);
        }
        self.push(Op::NewSet, NLM_F_CREATE, a);
    }

    /// Deletes set `name` (nothing if it is missing). No rule may refer to it by the end of
    /// the batch.
    pub fn destroy_set(&mut self, name: &str) {
        let mut a = Attrs::default();
        a.str(1, &self.table).str(2, name);
        self.push(Op::DestroySet, 0, a);
    }

    /// Deletes every element of set `name`.
    pub fn flush_set(&mut self, name: &str) {
        let mut a = Attrs::default();
        a.str(1, &self.table).str(2, name);
        self.push(Op::DelSetElem, 0, a);
    }

    /// Adds, deletes (`Op::DelSetElem`) or destroys (`Op::DestroySetElem`) `elems` of set
    /// `set`, in messages of at most 512 elements. An added element already there is left
    /// as it is.
    pub fn elements(&mut self, op: Op, set: &str, elems: &[Elem]) {
        for chunk in elems.chunks(512) {
            let mut a = Attrs::default();
            a.str(1, &self.table).str(2, set);
            a.begin(3);
            for e in chunk {
                a.begin(1).value(1, &e.key);
                if let Some(end) = &e.key_end {
                    a.value(10, end); // NFTA_SET_ELEM_KEY_END
                }
                if let Some(chain) = &e.jump {
                    a.verdict(2, NFT_JUMP, Some(chain));
                }
                if e.interval_end {
                    a.u32(3, 1); // NFTA_SET_ELEM_FLAGS
                }
                if let Some(t) = e.timeout_ms {
                    a.u64(4, t);
                }
                a.end();
            }
            a.end();
            let flags = if op == Op::NewSetElem {
                NLM_F_CREATE
            } else {
                0
            };
            self.push(op, flags, a);
        }
    }

    /// The batch's bytes, with its end marker.
    pub fn finish(mut self) -> Vec<u8> {
        self.message(0x11, NLM_F_REQUEST, 0, SUBSYS, Attrs::default());
        self.buf
    }
}

/// The request listing every set of `table` (family inet).
pub fn list_sets_request(table: &str) -> Vec<u8> {
    let mut a = Attrs::default();
    a.str(1, table);
    let body = a.into_bytes();
    let mut m = Vec::with_capacity(20 + body.len());
    m.extend_from_slice(&((20 + body.len()) as u32).to_ne_bytes());
    m.extend_from_slice(&((SUBSYS << 8) | 10u16).to_ne_bytes()); // NFT_MSG_GETSET
    m.extend_from_slice(&(NLM_F_REQUEST | 0x300).to_ne_bytes()); // NLM_F_DUMP
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&[FAMILY_INET, 0, 0, 0]);
    m.extend_from_slice(&body);
    m
}

/// The string attribute `kind` of a listed object (`payload`: the message after its netlink
/// header: `nfgenmsg`, then attributes), without its NUL.
pub fn string_attr(payload: &[u8], kind: u16) -> Option<String> {
    let mut at = 4;
    while let Some(&[l0, l1, k0, k1]) = payload.get(at..at + 4) {
        let len = usize::from(u16::from_ne_bytes([l0, l1]));
        let k = u16::from_ne_bytes([k0, k1]) & !NLA_F_NESTED;
        let value = payload.get(at + 4..at + len.max(4))?;
        if len < 4 {
            return None;
        }
        if k == kind {
            let v = value.split(|c| *c == 0).next().unwrap_or_default();
            return String::from_utf8(v.to_vec()).ok();
        }
        at += (len + 3) & !3;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (type, flags, seq) of every message of a batch.
    fn headers(b: &[u8]) -> Vec<(u16, u16, u32)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at + 16 <= b.len() {
            let len = u32::from_ne_bytes(b[at..at + 4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes(b[at + 4..at + 6].try_into().unwrap());
            let flags = u16::from_ne_bytes(b[at + 6..at + 8].try_into().unwrap());
            let seq = u32::from_ne_bytes(b[at + 8..at + 12].try_into().unwrap());
            out.push((kind, flags, seq));
            assert_eq!(len % 4, 0, "messages stay aligned");
            at += len;
        }
        assert_eq!(at, b.len(), "the lengths add up to the batch");
        out
    }

    #[test]
    fn a_batch_is_framed_by_its_markers_with_one_sequence_number_per_message() {
        let mut b = Batch::new("t");
        b.add_table();
        b.add_chain("c");
        b.flush_set("s");
        let h = headers(&b.finish());
        assert_eq!(
            h,
            vec![
                (0x10, 1, 0),
                (0xa00, 1 | 0x400, 1),
                (0xa03, 1 | 0x400, 2),
                (0xa0e, 1, 3),
                (0x11, 1, 4)
            ]
        );
    }

    #[test]
    fn nested_attributes_carry_their_length_and_flag() {
        let mut a = Attrs::default();
        a.begin(3).u32(1, 7).str(2, "ab").end();
        let b = a.into_bytes();
        // outer header (4) + u32 attribute (8) + "ab\0" attribute (4 + 3, padded to 8)
        assert_eq!(b.len(), 20);
        assert_eq!(u16::from_ne_bytes([b[0], b[1]]), 20);
        assert_eq!(u16::from_ne_bytes([b[2], b[3]]), 3 | NLA_F_NESTED);
        assert_eq!(&b[8..12], &7u32.to_be_bytes());
        assert_eq!(u16::from_ne_bytes([b[12], b[13]]), 7);
        assert_eq!(&b[16..20], b"ab\0\0");
    }

    #[test]
    fn many_elements_are_split_over_messages() {
        let mut b = Batch::new("t");
        let elems: Vec<Elem> = (0..1100u32)
            .map(|i| Elem::key(i.to_be_bytes().to_vec()))
            .collect();
        b.elements(Op::NewSetElem, "s", &elems);
        let h = headers(&b.finish());
        assert_eq!(h.len(), 2 + 3);
        assert!(h[1..4].iter().all(|m| m.0 == 0xa0c));
    }

    #[test]
    fn a_listed_name_is_read_back_and_junk_gives_none() {
        let mut a = Attrs::default();
        a.str(1, "opendsec-e1").u32(3, 4).str(2, "x-7-0");
        let mut payload = vec![1, 0, 0, 0];
        payload.extend(a.into_bytes());
        assert_eq!(string_attr(&payload, 2).as_deref(), Some("x-7-0"));
        assert_eq!(string_attr(&payload, 1).as_deref(), Some("opendsec-e1"));
        assert_eq!(string_attr(&payload, 9), None);
        assert_eq!(string_attr(&[1, 0, 0, 0, 200, 0, 2, 0], 2), None);
        assert_eq!(string_attr(&[], 2), None);
        let req = list_sets_request("t");
        assert_eq!(
            u32::from_ne_bytes(req[0..4].try_into().unwrap()) as usize,
            req.len()
        );
    }

    #[test]
    fn concatenated_types_compose_as_nft_shows_them() {
        assert_eq!(concat_type(&[TYPE_IFNAME, TYPE_IPV4]), (41 << 6) | 7);
        assert_eq!(
            concat_type(&[TYPE_IPV4, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            (7 << 12) | (12 << 6) | 13
        );
    }
}
