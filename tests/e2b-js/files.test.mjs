// E2B's `e2b` npm package reading, writing and watching files through the gateway's envd
// (docs/e2b.md "The in-sandbox API"), in real containers: byte-exact contents, listings,
// directories, renames, removals, metadata, directory watches and the errors the SDK throws.

import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { after, before, test } from 'node:test'

import {
  FileNotFoundError,
  FileType,
  FilesystemEventType,
  InvalidArgumentError,
  NotFoundError,
  Sandbox,
  SandboxError,
  TimeoutError,
} from 'e2b'

import { rejectsWith, sleep, waitUntil } from './helpers.mjs'

let sbx

before(async () => {
  sbx = await Sandbox.create()
})

after(async () => {
  await sbx?.kill()
})

const sha256 = (bytes) => createHash('sha256').update(bytes).digest('hex')
const inSandboxSha256 = async (path) => (await sbx.commands.run(`sha256sum ${path} | cut -d' ' -f1`)).stdout.trim()
/** An ArrayBuffer holding exactly `bytes` (a Buffer's .buffer may be a larger pool). */
const arrayBuffer = (bytes) => bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength)

test('text and binary round trips are byte-exact', async () => {
  const info = await sbx.files.write('/tmp/e2b/hello.txt', 'héllo\n')
  assert.equal(info.path, '/tmp/e2b/hello.txt')
  assert.equal(info.name, 'hello.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(await sbx.files.read('/tmp/e2b/hello.txt'), 'héllo\n')
  assert.equal((await sbx.commands.run('od -An -tx1 /tmp/e2b/hello.txt')).stdout.trim(), '68 c3 a9 6c 6c 6f 0a')

  // Every byte value, as an ArrayBuffer and as a Blob, read back as bytes.
  const every = new Uint8Array(1024).map((_, i) => i % 256)
  await sbx.files.write('/tmp/e2b/bin', arrayBuffer(every))
  const back = await sbx.files.read('/tmp/e2b/bin', { format: 'bytes' })
  assert.ok(back instanceof Uint8Array)
  assert.deepEqual(Buffer.from(back), Buffer.from(every))
  assert.equal(await inSandboxSha256('/tmp/e2b/bin'), sha256(every))
  await sbx.files.write('/tmp/e2b/blob', new Blob([every]))
  const blob = await sbx.files.read('/tmp/e2b/blob', { format: 'blob' })
  assert.deepEqual(Buffer.from(await blob.arrayBuffer()), Buffer.from(every))

  // Empty files too.
  await sbx.files.write('/tmp/e2b/empty', new ArrayBuffer(0))
  assert.equal((await sbx.files.read('/tmp/e2b/empty', { format: 'bytes' })).length, 0)
  assert.equal(await sbx.files.read('/tmp/e2b/empty'), '')
})

test('a file larger than one call of the API, written and read (also as a stream)', async () => {
  const big = Buffer.concat([randomBytes(9 << 20), Buffer.from('tail')])
  await sbx.files.write('/tmp/e2b/big', arrayBuffer(big))
  assert.equal((await sbx.commands.run('stat -c %s /tmp/e2b/big')).stdout, `${big.length}\n`)
  assert.equal(await inSandboxSha256('/tmp/e2b/big'), sha256(big))
  const back = await sbx.files.read('/tmp/e2b/big', { format: 'bytes' })
  assert.equal(back.length, big.length)
  assert.equal(sha256(back), sha256(big))
  const stream = await sbx.files.read('/tmp/e2b/big', { format: 'stream' })
  const chunks = []
  for await (const c of stream) chunks.push(Buffer.from(c))
  assert.equal(sha256(Buffer.concat(chunks)), sha256(big))
})

test('several files at once, missing parents made', async () => {
  const infos = await sbx.files.write([
    { path: '/tmp/e2b/many/a.txt', data: 'A' },
    { path: '/tmp/e2b/many/deep/b.txt', data: arrayBuffer(Buffer.from('B')) },
  ])
  assert.deepEqual(infos.map((i) => i.path).sort(), ['/tmp/e2b/many/a.txt', '/tmp/e2b/many/deep/b.txt'])
  assert.equal((await sbx.commands.run('cat /tmp/e2b/many/a.txt /tmp/e2b/many/deep/b.txt')).stdout, 'AB')
  const more = await sbx.files.writeFiles([{ path: '/tmp/e2b/many/c.txt', data: 'C' }])
  assert.deepEqual(more.map((i) => i.name), ['c.txt'])
  assert.equal(await sbx.files.read('/tmp/e2b/many/c.txt'), 'C')
})

test('streamed, gzip and octet-stream uploads are byte-exact', async () => {
  const pieces = [Buffer.from('first,'), Buffer.alloc(0), Buffer.from('second,'.repeat(1000)), randomBytes(3 << 20)]
  const stream = new ReadableStream({
    start(c) {
      for (const p of pieces) c.enqueue(new Uint8Array(p))
      c.close()
    },
  })
  const info = await sbx.files.write('/tmp/up/streamed', stream)
  assert.equal(info.path, '/tmp/up/streamed')
  assert.equal(await inSandboxSha256('/tmp/up/streamed'), sha256(Buffer.concat(pieces)))

  const big = randomBytes(10 << 20)
  await sbx.files.write('/tmp/up/gz', arrayBuffer(big), { gzip: true })
  assert.equal(await inSandboxSha256('/tmp/up/gz'), sha256(big))
  await sbx.files.write('/tmp/up/text', 'héllo', { useOctetStream: true })
  assert.equal(await sbx.files.read('/tmp/up/text'), 'héllo')
  await sbx.files.write('/tmp/up/empty', '', { useOctetStream: true })
  assert.equal((await sbx.commands.run('stat -c %s /tmp/up/empty')).stdout, '0\n')
})

test('signed upload and download URLs work with no other credential', async () => {
  const headers = { 'E2b-Sandbox-Id': sbx.sandboxId }
  // The SDK builds them on E2B_SANDBOX_URL, which names no sandbox: the header does.
  const up = await sbx.uploadUrl('/tmp/signed/up.txt')
  assert.ok(up.startsWith(`${process.env.E2B_SANDBOX_URL}/files?`), up)
  assert.match(new URL(up).searchParams.get('signature'), /^v1_/)
  const form = new FormData()
  form.append('file', new Blob(['uploaded by url']), 'up.txt')
  const r = await fetch(up, { method: 'POST', body: form, headers })
  assert.equal(r.status, 200)
  assert.deepEqual(await r.json(), [{ name: 'up.txt', path: '/tmp/signed/up.txt', type: 'file' }])
  assert.equal(await sbx.files.read('/tmp/signed/up.txt'), 'uploaded by url')

  const down = await sbx.downloadUrl('/tmp/signed/up.txt', { useSignatureExpiration: 60 })
  const d = await fetch(down, { headers })
  assert.equal(d.status, 200)
  assert.equal(await d.text(), 'uploaded by url')

  // A signature is for its path and its operation only.
  const other = new URL(down)
  other.searchParams.set('path', '/tmp/signed/other.txt')
  assert.equal((await fetch(other, { headers })).status, 401)
  assert.equal((await fetch(up, { headers })).status, 401)
})

test('list, getInfo, exists, makeDir, rename and remove', async () => {
  await sbx.files.write('/tmp/e2b/tree/x.txt', '12345')
  assert.equal(await sbx.files.makeDir('/tmp/e2b/tree/sub'), true)
  // Already there: false, as the SDK reports E2B's already_exists.
  assert.equal(await sbx.files.makeDir('/tmp/e2b/tree/sub'), false)
  assert.equal(await sbx.files.makeDir('/tmp/e2b/tree/p/q/r'), true)

  const entries = Object.fromEntries((await sbx.files.list('/tmp/e2b/tree')).map((e) => [e.name, e]))
  assert.deepEqual(Object.keys(entries).sort(), ['p', 'sub', 'x.txt'])
  assert.equal(entries['x.txt'].type, FileType.FILE)
  assert.equal(entries['x.txt'].size, 5)
  assert.equal(entries['x.txt'].path, '/tmp/e2b/tree/x.txt')
  assert.equal(entries.sub.type, FileType.DIR)
  // depth 3 reaches /tmp/e2b/tree/p/q/r, depth 1 only the first level.
  const deep = (await sbx.files.list('/tmp/e2b/tree', { depth: 3 })).map((e) => e.path).sort()
  assert.deepEqual(deep, [
    '/tmp/e2b/tree/p',
    '/tmp/e2b/tree/p/q',
    '/tmp/e2b/tree/p/q/r',
    '/tmp/e2b/tree/sub',
    '/tmp/e2b/tree/x.txt',
  ])

  const info = await sbx.files.getInfo('/tmp/e2b/tree/x.txt')
  assert.equal(info.name, 'x.txt')
  assert.equal(info.path, '/tmp/e2b/tree/x.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.size, 5)
  assert.equal(info.permissions, '-rw-r--r--')
  assert.equal(info.mode & 0o777, 0o644)
  assert.equal(info.owner, 'root')
  assert.equal(info.group, 'root')
  assert.ok(info.modifiedTime instanceof Date && Math.abs(info.modifiedTime.getTime() - Date.now()) < 60_000)
  const dir = await sbx.files.getInfo('/tmp/e2b/tree/sub')
  assert.equal(dir.type, FileType.DIR)
  assert.equal(dir.permissions, 'drwxr-xr-x')
  await sbx.commands.run('ln -sfn x.txt /tmp/e2b/tree/link')
  assert.equal((await sbx.files.getInfo('/tmp/e2b/tree/link')).symlinkTarget, 'x.txt')
  await sbx.files.remove('/tmp/e2b/tree/link')

  assert.equal(await sbx.files.exists('/tmp/e2b/tree/x.txt'), true)
  assert.equal(await sbx.files.exists('/tmp/e2b/tree/sub'), true)
  assert.equal(await sbx.files.exists('/tmp/e2b/tree/nope'), false)

  const moved = await sbx.files.rename('/tmp/e2b/tree/x.txt', '/tmp/e2b/tree/sub/y.txt')
  assert.equal(moved.path, '/tmp/e2b/tree/sub/y.txt')
  assert.equal(moved.name, 'y.txt')
  assert.equal(moved.size, 5)
  assert.equal(await sbx.files.exists('/tmp/e2b/tree/x.txt'), false)
  assert.equal(await sbx.files.read('/tmp/e2b/tree/sub/y.txt'), '12345')

  await sbx.files.remove('/tmp/e2b/tree/sub/y.txt')
  assert.equal(await sbx.files.exists('/tmp/e2b/tree/sub/y.txt'), false)
  // A directory is removed with what it holds.
  await sbx.files.remove('/tmp/e2b/tree')
  assert.equal(await sbx.files.exists('/tmp/e2b/tree'), false)
  assert.equal((await sbx.commands.run('test -e /tmp/e2b/tree && echo there || echo gone')).stdout, 'gone\n')
})

// envd resolves every path as its permissions.ExpandAndResolve does: `~` and `~/...` are the
// user's home, a relative path is joined to the home, and the answers carry the result. The
// default user of `base` is root, whose home is /root.

test('getInfo and list of relative paths answer with absolute paths', async () => {
  assert.equal((await sbx.commands.run('echo $HOME; pwd')).stdout, '/root\n/root\n')
  await sbx.commands.run('mkdir -p /root/rel0 && echo -n x > /root/rel0/a.txt')
  assert.equal((await sbx.files.getInfo('rel0/a.txt')).path, '/root/rel0/a.txt')
  assert.deepEqual((await sbx.files.list('rel0')).map((e) => e.path), ['/root/rel0/a.txt'])
  assert.equal(await sbx.files.read('rel0/a.txt'), 'x')
  assert.equal((await sbx.files.rename('rel0/a.txt', 'rel0/b.txt')).path, '/root/rel0/b.txt')
})

test('a file written at a relative path is answered with its absolute path', async () => {
  const rel = await sbx.files.write('rel1/a.txt', 'relative')
  assert.equal((await sbx.commands.run('cat /root/rel1/a.txt')).stdout, 'relative')
  assert.equal(rel.path, '/root/rel1/a.txt')
  const [multi] = await sbx.files.write([{ path: 'rel1/b.txt', data: 'b' }])
  assert.equal(multi.path, '/root/rel1/b.txt')
  const octet = await sbx.files.write('rel1/c.txt', 'c', { useOctetStream: true })
  assert.equal(octet.path, '/root/rel1/c.txt')
})

test('~ is the home directory', async () => {
  const tilde = await sbx.files.write('~/tilde.txt', 'tilde')
  assert.equal((await sbx.commands.run('cat /root/tilde.txt 2>&1 || true')).stdout, 'tilde')
  assert.equal(tilde.path, '/root/tilde.txt')
  assert.equal((await sbx.files.getInfo('~/tilde.txt')).path, '/root/tilde.txt')
  assert.equal(await sbx.files.makeDir('~/tilde-dir'), true)
  assert.equal((await sbx.commands.run('test -d /root/tilde-dir && echo dir || echo none')).stdout, 'dir\n')
  assert.equal((await sbx.commands.run("test -e '/root/~' && echo there || echo none")).stdout, 'none\n')
})

test('removing a path that is not there succeeds', async () => {
  // envd removes with os.RemoveAll, which is no error for a missing path.
  await sbx.files.remove('/tmp/e2b/never/was')
  assert.equal(await sbx.files.exists('/tmp/e2b/never/was'), false)
})

test('makeDir where a file is, is InvalidArgumentError (false is for a directory there)', async () => {
  await sbx.files.write('/tmp/e2b/plain-file-1', 'x')
  // envd: "path already exists but it is not a directory" (invalid_argument).
  await rejectsWith(sbx.files.makeDir('/tmp/e2b/plain-file-1'), InvalidArgumentError)
})

test('listing a file is InvalidArgumentError, not FileNotFoundError', async () => {
  await sbx.files.write('/tmp/e2b/plain-file-2', 'x')
  // envd: "path is not a directory" (invalid_argument).
  await rejectsWith(sbx.files.list('/tmp/e2b/plain-file-2'), InvalidArgumentError)
})

test('missing files are FileNotFoundError', async () => {
  for (const call of [
    () => sbx.files.read('/tmp/e2b/no/such/file'),
    () => sbx.files.getInfo('/tmp/e2b/no/such/file'),
    () => sbx.files.list('/tmp/e2b/no/such/dir'),
    () => sbx.files.rename('/tmp/e2b/no/such/file', '/tmp/e2b/elsewhere'),
  ]) {
    const e = await rejectsWith(call(), FileNotFoundError)
    assert.ok(e instanceof NotFoundError && e instanceof SandboxError)
  }
  // A directory is no file to read.
  await rejectsWith(sbx.files.read('/tmp'), InvalidArgumentError)
})

test('files are read and written as the user a call names', async () => {
  await sbx.files.write('/tmp/users/private', "root's")
  await sbx.commands.run('chmod 600 /tmp/users/private && chmod 1777 /tmp/users')
  const info = await sbx.files.write('/tmp/users/theirs.txt', "nobody's", { user: 'nobody' })
  assert.equal(info.path, '/tmp/users/theirs.txt')
  assert.equal((await sbx.files.getInfo('/tmp/users/theirs.txt')).owner, 'nobody')
  assert.equal(await sbx.files.read('/tmp/users/theirs.txt', { user: 'nobody' }), "nobody's")
  const e = await rejectsWith(sbx.files.read('/tmp/users/private', { user: 'nobody' }), SandboxError)
  assert.match(e.message, /ermission denied/)
  assert.equal(await sbx.files.read('/tmp/users/private'), "root's")
  await rejectsWith(sbx.files.read('/tmp/users/theirs.txt', { user: 'no-such-user' }), InvalidArgumentError)
})

test('file metadata is kept, replaced and shown by getInfo, list and rename', async () => {
  const info = await sbx.files.write('/tmp/meta/a.txt', 'x', { metadata: { Kind: 'report', step: '1' } })
  // Keys travel as header names: lower-cased.
  assert.deepEqual(info.metadata, { kind: 'report', step: '1' })
  assert.deepEqual((await sbx.files.getInfo('/tmp/meta/a.txt')).metadata, { kind: 'report', step: '1' })
  const listed = (await sbx.files.list('/tmp/meta')).find((e) => e.name === 'a.txt')
  assert.deepEqual(listed.metadata, { kind: 'report', step: '1' })
  const moved = await sbx.files.rename('/tmp/meta/a.txt', '/tmp/meta/b.txt')
  assert.deepEqual(moved.metadata, { kind: 'report', step: '1' })
  await sbx.files.write('/tmp/meta/b.txt', 'y', { metadata: { step: '2' } })
  assert.deepEqual((await sbx.files.getInfo('/tmp/meta/b.txt')).metadata, { step: '2' })
  // An upload without metadata clears it.
  await sbx.files.write('/tmp/meta/b.txt', 'z')
  assert.equal((await sbx.files.getInfo('/tmp/meta/b.txt')).metadata, undefined)
})

/** Starts a watch of `dir` that records [name, type] pairs; returns the handle and the list. */
async function watch(dir, opts = {}) {
  const events = []
  const exits = []
  const handle = await sbx.files.watchDir(dir, (e) => events.push([e.name, e.type]), {
    ...opts,
    onExit: (err) => exits.push(err),
  })
  return { handle, events, exits }
}

const has = (events, name, type) => events.some(([n, t]) => n === name && t === type)

test('watchDir sees a file created, written, chmodded, renamed and removed', async () => {
  await sbx.files.makeDir('/tmp/w1')
  const { handle, events, exits } = await watch('/tmp/w1')
  await sbx.files.write('/tmp/w1/a.txt', 'hello')
  await waitUntil('the write of a.txt', () => has(events, 'a.txt', FilesystemEventType.WRITE))
  assert.ok(has(events, 'a.txt', FilesystemEventType.CREATE), JSON.stringify(events))
  await sbx.commands.run('chmod 600 /tmp/w1/a.txt && mv /tmp/w1/a.txt /tmp/w1/b.txt && rm /tmp/w1/b.txt')
  await waitUntil('the removal of b.txt', () => has(events, 'b.txt', FilesystemEventType.REMOVE))
  for (const [name, type] of [
    ['a.txt', FilesystemEventType.CHMOD],
    ['a.txt', FilesystemEventType.RENAME],
    ['b.txt', FilesystemEventType.CREATE],
  ]) {
    assert.ok(has(events, name, type), `${name} ${type} not in ${JSON.stringify(events)}`)
  }
  // Only names in the watched directory, relative to it.
  assert.deepEqual([...new Set(events.map(([n]) => n))].sort(), ['a.txt', 'b.txt'])
  await handle.stop()
  // Stopped means stopped: nothing more arrives.
  const n = events.length
  await sbx.files.write('/tmp/w1/after.txt', 'x')
  await sleep(500)
  assert.deepEqual(events.slice(n), [])
  // stop() aborts the SDK's own request, so its onExit hears of the abort, once.
  await waitUntil('onExit', () => exits.length === 1)
  assert.ok(exits[0] instanceof TimeoutError, String(exits[0]))
  assert.match(exits[0].message, /^\[canceled\]/)
})

test('a recursive watch follows directories made later; a flat one sees only its level', async () => {
  await sbx.files.makeDir('/tmp/w2')
  const deep = await watch('/tmp/w2', { recursive: true })
  const flat = await watch('/tmp/w2')
  await sbx.files.makeDir('/tmp/w2/sub/inner')
  await sbx.files.write('/tmp/w2/sub/inner/f.txt', 'x')
  await waitUntil('the nested write', () => has(deep.events, 'sub/inner/f.txt', FilesystemEventType.WRITE))
  assert.ok(has(deep.events, 'sub', FilesystemEventType.CREATE), JSON.stringify(deep.events))
  await sleep(500)
  assert.deepEqual(flat.events, [['sub', FilesystemEventType.CREATE]])
  await deep.handle.stop()
  await flat.handle.stop()
})

test('a watch with includeEntry gives each event its entry', async () => {
  await sbx.files.makeDir('/tmp/w4')
  const events = []
  const handle = await sbx.files.watchDir('/tmp/w4', (e) => events.push(e), { includeEntry: true })
  await sbx.files.write('/tmp/w4/f.txt', 'hello', { metadata: { k: 'v' } })
  // Setting the metadata, after the data, is a change of attributes: chmod.
  await waitUntil('the metadata change', () => events.some((e) => e.name === 'f.txt' && e.type === FilesystemEventType.CHMOD))
  const write = events.filter((e) => e.name === 'f.txt' && e.type === FilesystemEventType.WRITE).at(-1)
  assert.ok(write, JSON.stringify(events))
  assert.equal(write.entry?.name, 'f.txt')
  assert.equal(write.entry.path, '/tmp/w4/f.txt')
  assert.equal(write.entry.type, FileType.FILE)
  assert.equal(write.entry.size, 5)
  const chmod = events.filter((e) => e.name === 'f.txt' && e.type === FilesystemEventType.CHMOD).at(-1)
  assert.deepEqual(chmod.entry?.metadata, { k: 'v' })
  await handle.stop()
})

test('a watch ends with its timeout; a missing directory is not found', async () => {
  await sbx.files.makeDir('/tmp/w3')
  const { exits } = await watch('/tmp/w3', { timeoutMs: 1000 })
  const started = Date.now()
  await waitUntil('the watch to end', () => exits.length === 1, 10_000)
  assert.ok(Date.now() - started < 8000)
  assert.ok(exits[0] instanceof TimeoutError, String(exits[0]))
  assert.match(exits[0].message, /^\[deadline_exceeded\]/)
  await rejectsWith(sbx.files.watchDir('/tmp/w3/none', () => {}), NotFoundError)
})
