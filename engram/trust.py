"""What the daemons of one cluster prove to each other, so that Redis need not be trusted.

Redis is shared infrastructure: whoever can write to it (a compromised client, a neighbour on an open
port) could publish a holder address of its own choosing, and the daemon that dialled it handed over its
peer token; or advertise a checksum for a forged block, which the fetching daemon then checked the forgery
against. So nothing read from Redis is believed unless a daemon of the cluster signed it, and no block
fetched from a peer is believed unless the peer proves it knows the cluster secret over the block's bytes:

- `cluster.secret` (the same on every node; env:VAR / file:PATH) is the one root of trust. Keys derived
  from it (HMAC-SHA256 with a distinct label each) sign node records, sign holder records, MAC blocks and
  derive the peer token when `cluster.peer_token` is not set.
- Node record (`address|ts_ms|sig`): a node's advertised address, signed with its node id and the time it
  was written. A daemon dials only addresses whose record verifies and is fresh (written within
  `ttl_s + CLOCK_SKEW_S`), so the peer token goes only to an address a daemon of the cluster published, and
  a copied old record stops working once it is stale.
- Holder record (`tier#tag@boot|size|checksum|sig`): that node holds block `key`; signed with the key and node
  id, so a record cannot be moved to another block or node. `boot` is the writing process's start (its boot
  record's): a node restarted under its id (DRAM only: its blocks gone) cannot know which records its earlier
  process left, so readers tell them by it. `tag` names the block's namespace (`namespace_tag`): a keyed digest
  of the namespace and the key, so a reader skips another namespace's holders without asking them (asking told
  a tenant, by the time its Get took, which keys exist in other namespaces), while Redis, without the secret,
  learns neither a namespace's name nor which blocks share one. Both ride in the tier field, which an older
  daemon reads whole (before boots) or up to its `@` (before tags) and uses for nothing: its reads of these
  records go on; a record without them (an older daemon's) still reads, its `tag` None. Being among the signed
  fields, a tag altered or made up is refused like any forged record.
- Boot record (`boot|sig`): when the node's current process started (ms), signed with its node id.
- Node proof: beside the peer token a daemon sends its node id and a MAC of it (`peer_metadata`), so the daemon
  it calls counts the call against that node's own share of calls (principal `peer:<node id>`), not one share
  every peer has together: one peer's many calls starved the others. The cluster secret never travels, so a
  peer token seen on the wire cannot make up node ids (and shares) of its own; but a proof is the same on
  every call (no nonce, no time), so one seen with it can be replayed to use that node's share (TLS between
  daemons keeps both off the wire; the peer token alone already reads every namespace by FetchBlocks).
- Grants record (`digest|sig`): what decides access on the node (`grants_digest`: tenants' tokens and namespaces,
  admin tokens, the salt secret, all hashed and keyed), signed with its node id: published in Redis, and sent
  beside the node proof on each call (`peer_metadata`), so that under cluster.peer_grants = "same" a daemon
  serves and fetches from only peers of its own grants (ClusterIndex.check_peer, ClusterIndex.holders).
- Block MAC: the serving daemon sends HMAC(key, parent, namespace, model, codec, BLAKE2b(payload)) with
  each block; the fetching daemon computes the same MAC itself over what it received and drops the block
  unless they match. The key is recomputed from parent and tokens by the store as for every put, so a block
  verified here is the block its key names, written by a daemon that holds the secret. (xxh3, the payload
  checksum, guards against bit flips, not forgers; BLAKE2b under the MAC does.)

What this does not do: encrypt. Blocks travel in the clear unless the peers serve TLS
(`server.tls_cert`, `cluster.peer_root_cert`); the peer token is then also safe from a network observer.
A holder of the cluster secret is a member of the cluster and trusted with every namespace's blocks.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

from engram.config import ClusterConfig
from engram.errors import ConfigError
from engram.wire.channel import header_safe

CLOCK_SKEW_S = 30.0  # how far nodes' clocks may disagree before a fresh node record looks stale
MAC_BYTES = 32
NODE_HEADER, PROOF_HEADER = "engram-peer-node", "engram-peer-proof"  # a peer's node id and its proof (`peer_node`)
GRANTS_HEADER = "engram-peer-grants"  # a peer's signed grants record (`peer_grants`)


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(4, "little") + value  # length-prefixed: fields cannot run into each other


def _signed(want: str, sig: str) -> bool:
    """Whether a record's signature `sig` (as Redis gave it) is `want`, in constant time. Compared as bytes:
    hmac.compare_digest of two str raises TypeError for one that is not ASCII, and whoever can write Redis wrote
    "é" where a signature goes, which ended a daemon's heartbeat and failed every lookup that met the record (a
    review, session 53)."""
    return hmac.compare_digest(want.encode(), sig.encode(errors="replace"))


@dataclass(frozen=True)
class HolderEntry:
    tier: str
    size: int
    checksum: int
    boot: int | None = None  # the writing process's start (ms); None in an older daemon's record
    tag: str | None = None  # the block's namespace's tag (ClusterTrust.namespace_tag); None in an older daemon's


class ClusterTrust:
    def __init__(self, secret: bytes, peer_token: str = "", *, ttl_s: float = 10.0) -> None:
        if not secret:
            raise ConfigError("cluster.secret is empty: daemons sign what they publish in Redis and MAC the "
                              "blocks they send each other with it; set the same secret on every node")
        self._node_key = self._derive(secret, b"node-record")
        self._holder_key = self._derive(secret, b"holder-record")
        self._boot_key = self._derive(secret, b"boot-record")
        self._block_key = self._derive(secret, b"block-mac")
        self._peer_node_key = self._derive(secret, b"peer-node")
        self._tag_key = self._derive(secret, b"namespace-tag")
        self._grants_key = self._derive(secret, b"grants")
        self.peer_token = peer_token or self._derive(secret, b"peer-token").hex()
        self.max_age_ms = int((ttl_s + CLOCK_SKEW_S) * 1000)

    @classmethod
    def from_config(cls, c: ClusterConfig) -> ClusterTrust:
        from engram.tenancy import resolve_secret

        secret = resolve_secret(c.secret, "cluster.secret").encode()
        token = resolve_secret(c.peer_token, "cluster.peer_token") if c.peer_token else ""
        return cls(secret, token, ttl_s=c.ttl_s)

    @staticmethod
    def _derive(secret: bytes, label: bytes) -> bytes:
        return hmac.new(secret, b"engram/cluster/v1\0" + label, hashlib.sha256).digest()

    @staticmethod
    def _mac(key: bytes, parts: Iterable[bytes]) -> bytes:
        h = hmac.new(key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(_field(p))
        return h.digest()

    def is_peer_call(self, metadata: object) -> bool:
        """Whether a call carries `authorization: Bearer <the peer token>`."""
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == "authorization":
                scheme, _, token = str(value).partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.peer_token.encode()):
                    return True
        return False

    def node_proof(self, node_id: str) -> str:
        return self._mac(self._peer_node_key, (node_id.encode(),)).hex()

    def peer_metadata(self, node_id: str, grants: str = "") -> tuple[tuple[str, str], ...]:
        """What this daemon sends with its peer token so that the daemons it calls know it by its node id, and its
        grants (`grants_digest`), in a signed record as the one it publishes in Redis (`grants_record`): a peer
        serves FetchBlocks only to a daemon whose grants are its own (cluster.peer_grants = "same": `peer_grants`).
        A node id that cannot travel in a header (a space, a character beyond ASCII) travels percent-encoded, the
        proof and the record made for that form: it went without, and under "same" every peer refused its calls
        as a daemon of other grants (session 54)."""
        node = node_id if header_safe(node_id) else quote(node_id, safe="")
        sent = ((NODE_HEADER, node), (PROOF_HEADER, self.node_proof(node)))
        return (*sent, (GRANTS_HEADER, self.grants_record(node, grants))) if grants else sent

    def peer_node(self, metadata: object) -> str:
        """The node id a call proves (`peer_metadata`), or "" when it proves none."""
        node = proof = ""
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == NODE_HEADER:
                node = str(value)
            elif key == PROOF_HEADER:
                proof = str(value)
        if node and hmac.compare_digest(proof.encode(), self.node_proof(node).encode()):
            return node
        return ""

    def peer_grants(self, metadata: object, node_id: str) -> str | None:
        """The grants digest a call of `node_id` (as `peer_node` proved) sends in its signed grants record; None
        when it sends none (a daemon older than this one) or one that does not verify (altered, another node's)."""
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == GRANTS_HEADER:
                return self.node_grants(node_id, str(value))
        return None

    # ---- node records -------------------------------------------------------------------------------

    def node_record(self, node_id: str, address: str, now_ms: int | None = None) -> str:
        ts = str(int(time.time() * 1000) if now_ms is None else now_ms)
        sig = self._mac(self._node_key, (node_id.encode(), address.encode(), ts.encode())).hex()
        return f"{address}|{ts}|{sig}"

    def node_address(self, node_id: str, record: str, now_ms: int | None = None) -> str | None:
        """The address a signed, fresh node record holds; None for a forged, altered or stale one."""
        signed = self._signed_node_record(node_id, record, now_ms)
        if signed is None or not -self.max_age_ms <= signed[1] <= self.max_age_ms:
            return None
        return signed[0]

    def node_record_age_s(self, node_id: str, record: str, now_ms: int | None = None) -> float | None:
        """How old a node record whose signature verifies is by this daemon's clock (negative: dated ahead of
        it); None when it does not verify. Why node_address refused a signed record: the two clocks differ by
        more than ttl_s + CLOCK_SKEW_S (Redis expires a record ttl_s after its write), or it was replayed."""
        signed = self._signed_node_record(node_id, record, now_ms)
        return None if signed is None else signed[1] / 1000

    def _signed_node_record(self, node_id: str, record: str, now_ms: int | None) -> tuple[str, int] | None:
        """(address, age in ms by this daemon's clock) of a node record whose signature verifies, else None."""
        try:
            address, ts, sig = record.rsplit("|", 2)
            age = (int(time.time() * 1000) if now_ms is None else now_ms) - int(ts)
        except ValueError:
            return None
        want = self._mac(self._node_key, (node_id.encode(), address.encode(), ts.encode())).hex()
        return (address, age) if _signed(want, sig) else None

    def boot_record(self, node_id: str, boot: int) -> str:
        return f"{boot}|{self._mac(self._boot_key, (node_id.encode(), str(boot).encode())).hex()}"

    def node_boot(self, node_id: str, record: str) -> int | None:
        """The start time a signed boot record holds; None for a forged or altered one."""
        boot, _, sig = record.rpartition("|")
        want = self._mac(self._boot_key, (node_id.encode(), boot.encode())).hex()
        if not _signed(want, sig):
            return None
        try:
            return int(boot)
        except ValueError:
            return None

    def grants_digest(self, grants: Iterable[bytes] | None) -> str:
        """What decides access on a daemon (Tenancy.grants: tenants' tokens and namespaces, admin tokens, the salt
        secret; None: tenancy off, every caller may use every namespace), as a digest keyed with the cluster
        secret: daemons compare theirs (through Redis, and on each FetchBlocks: `peer_grants`), and Redis learns
        neither a tenant's name, a namespace's nor anything of a token or the salt secret. The order does not
        matter. "v2": a daemon before admin tokens and the salt secret were covered (session 53) digests
        otherwise, and is told apart as granting otherwise."""
        if grants is None:
            return self._mac(self._grants_key, (b"open",)).hex()[:32]
        return self._mac(self._grants_key, [b"tenants/v2", *sorted(grants)]).hex()[:32]

    def grants_record(self, node_id: str, digest: str) -> str:
        return f"{digest}|{self._mac(self._grants_key, (node_id.encode(), digest.encode())).hex()}"

    def node_grants(self, node_id: str, record: str) -> str | None:
        """The grants digest a signed grants record holds; None for a forged or altered one."""
        digest, _, sig = record.rpartition("|")
        want = self._mac(self._grants_key, (node_id.encode(), digest.encode())).hex()
        return digest if _signed(want, sig) else None

    # ---- holder records -----------------------------------------------------------------------------

    def namespace_tag(self, key: bytes, namespace: str) -> str:
        """What a holder record of block `key` says its namespace is: a digest keyed with the cluster secret, of
        the key too, so that Redis can neither name the namespace nor group the blocks of one (8 bytes: a reader
        compares it with its caller's namespace's, and a collision would only cost it a refused fetch)."""
        return hashlib.blake2b(_field(key) + namespace.encode(), key=self._tag_key, digest_size=8).hexdigest()

    def holder_record(self, key: bytes, node_id: str, tier: str, size: int, checksum: int,
                      boot: int | None = None, namespace: str | None = None) -> str:
        """The signed entry a node publishes for a block it holds (namespace None, boot None: as an older
        daemon wrote it, for tests of a rolling upgrade)."""
        tagged = tier if namespace is None else f"{tier}#{self.namespace_tag(key, namespace)}"
        fields = f"{tagged if boot is None else f'{tagged}@{boot}'}|{size}|{checksum}"
        return f"{fields}|{self._mac(self._holder_key, (key, node_id.encode(), fields.encode())).hex()}"

    def holder_entry(self, key: bytes, node_id: str, record: str) -> HolderEntry | None:
        """What a signed holder record says; None for one that does not verify (forged, moved, altered)."""
        fields, _, sig = record.rpartition("|")
        want = self._mac(self._holder_key, (key, node_id.encode(), fields.encode())).hex()
        if not _signed(want, sig):
            return None
        try:
            tier_boot, size, checksum = fields.split("|")
            tier_tag, at, boot = tier_boot.partition("@")
            tier, hashed, tag = tier_tag.partition("#")
            return HolderEntry(tier, int(size), int(checksum), int(boot) if at else None, tag if hashed else None)
        except ValueError:
            return None

    # ---- blocks -------------------------------------------------------------------------------------

    def block_mac(self, key: bytes, parent: bytes, namespace: str, fingerprint: bytes, codec: str,
                  payload: bytes | memoryview) -> bytes:
        digest = hashlib.blake2b(payload, digest_size=32).digest()
        return self._mac(self._block_key, (key, parent, namespace.encode(), fingerprint, codec.encode(), digest))

    def block_verifies(self, mac: bytes, key: bytes, parent: bytes, namespace: str, fingerprint: bytes, codec: str,
                       payload: bytes | memoryview) -> bool:
        return hmac.compare_digest(mac, self.block_mac(key, parent, namespace, fingerprint, codec, payload))
