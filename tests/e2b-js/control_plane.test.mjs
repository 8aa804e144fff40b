// E2B's `e2b` npm package against the gateway's control plane (docs/e2b.md "What works"):
// creation, information, listing, timeouts, connecting, pausing and resuming, killing, and
// the errors the SDK throws. Every call is the SDK's public API; only the three E2B_*
// variables point it at the cluster.

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { test } from 'node:test'

import {
  AuthenticationError,
  NotFoundError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
  TimeoutError,
} from 'e2b'

import { exists, pids, rejectsWith, waitUntil } from './helpers.mjs'

/** Seconds from now until `date`. */
const secondsUntil = (date) => (date.getTime() - Date.now()) / 1000

test('create with metadata, envs and a timeout; getInfo; kill; a killed sandbox is not found', async () => {
  const sbx = await Sandbox.create('base', {
    metadata: { run: 'a b&c=d', who: 'node-test' },
    envs: { FROM_CREATE: 'made' },
    timeoutMs: 120_000,
  })
  let killed = false
  try {
    // Our ids are <edge>.<random>; E2B's go into host names, so the dot is a dash.
    assert.match(sbx.sandboxId, /^node-0-[0-9a-f]{16}$/)
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.templateId, 'base')
    assert.deepEqual(info.metadata, { run: 'a b&c=d', who: 'node-test' })
    assert.equal(info.state, 'running')
    assert.equal((info.endAt.getTime() - info.startedAt.getTime()) / 1000, 120)
    assert.ok(Math.abs(secondsUntil(info.startedAt)) < 30, `startedAt ${info.startedAt.toISOString()}`)
    assert.equal(info.cpuCount, 1)
    assert.equal(info.memoryMB, 512)
    assert.match(info.envdVersion, /^\d+\.\d+\.\d+$/)
    assert.deepEqual(info.lifecycle, { onTimeout: 'kill', autoResume: true })
    // The static form reads the same sandbox.
    assert.deepEqual((await Sandbox.getInfo(sbx.sandboxId)).metadata, info.metadata)
    // Creation envs reach commands.
    assert.equal((await sbx.commands.run('echo $FROM_CREATE')).stdout, 'made\n')
    // No per-sandbox metrics are collected: an empty list, not an error.
    assert.deepEqual(await sbx.getMetrics(), [])
    assert.equal(await sbx.isRunning(), true)
    assert.equal(await sbx.kill(), true)
    killed = true
  } finally {
    if (!killed) await sbx.kill()
  }
  // E2B forgets a killed sandbox: a second kill is false, reading or connecting is not found.
  assert.equal(await sbx.kill(), false)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  assert.equal(await sbx.isRunning(), false)
  const e1 = await rejectsWith(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
  assert.ok(e1 instanceof NotFoundError)
  assert.equal(e1.message, `Sandbox ${sbx.sandboxId} not found`)
  await rejectsWith(Sandbox.connect(sbx.sandboxId), SandboxNotFoundError)
  await rejectsWith(sbx.setTimeout(10_000), SandboxNotFoundError)
  // In-sandbox calls on a killed sandbox fail as on E2B: a command's stream is unavailable,
  // a file call gets the proxy's 502, which the SDK reports as a timeout.
  const e2 = await rejectsWith(sbx.commands.run('true'), SandboxNotFoundError)
  assert.equal(e2.message, 'Sandbox is probably not running anymore')
  const e3 = await rejectsWith(sbx.files.read('/etc/hostname'), TimeoutError)
  assert.match(e3.message, /was not found/)
})

test('Sandbox.list filters by metadata and state, pages and orders', async () => {
  const tag = randomUUID()
  const made = []
  try {
    for (let i = 0; i < 3; i++) {
      made.push(await Sandbox.create({ metadata: { tag, i: String(i), odd: 'x y/z%' } }))
    }
    assert.equal(await made[0].pause(), true)

    // Two pages of at most two: each sandbox once, newest first.
    const paginator = Sandbox.list({ query: { metadata: { tag } }, limit: 2 })
    const listed = []
    let pages = 0
    while (paginator.hasNext) {
      const items = await paginator.nextItems()
      assert.ok(items.length <= 2, `a page of ${items.length}`)
      listed.push(...items)
      pages++
    }
    assert.equal(pages, 2)
    const ids = listed.map((s) => s.sandboxId)
    assert.deepEqual([...ids].sort(), made.map((s) => s.sandboxId).sort())
    // Start times are whole seconds: ties go in id order.
    const keys = listed.map((s) => [s.startedAt.getTime(), s.sandboxId])
    const newestFirst = [...keys].sort((a, b) => b[0] - a[0] || (a[1] < b[1] ? 1 : a[1] > b[1] ? -1 : 0))
    assert.deepEqual(keys, newestFirst)
    for (const s of listed) {
      const i = made.findIndex((m) => m.sandboxId === s.sandboxId)
      assert.deepEqual(s.metadata, { tag, i: String(i), odd: 'x y/z%' })
      assert.equal(s.templateId, 'base')
      assert.equal(s.state, i === 0 ? 'paused' : 'running')
    }

    const running = await Sandbox.list({ query: { metadata: { tag }, state: ['running'] } }).nextItems()
    assert.deepEqual(running.map((s) => s.sandboxId).sort(), made.slice(1).map((s) => s.sandboxId).sort())
    const paused = await Sandbox.list({ query: { metadata: { tag }, state: ['paused'] } }).nextItems()
    assert.deepEqual(paused.map((s) => s.sandboxId), [made[0].sandboxId])
    // Metadata values with spaces, slashes and percent signs match exactly, and only so.
    const odd = await Sandbox.list({ query: { metadata: { tag, odd: 'x y/z%' } } }).nextItems()
    assert.equal(odd.length, 3)
    assert.deepEqual(await Sandbox.list({ query: { metadata: { tag, odd: 'x y' } } }).nextItems(), [])
    const one = await Sandbox.list({ query: { metadata: { tag, i: '2' } } }).nextItems()
    assert.deepEqual(one.map((s) => s.sandboxId), [made[2].sandboxId])
    const asc = await Sandbox.list({ query: { metadata: { tag } }, order: 'asc' }).nextItems()
    assert.deepEqual(asc.map((s) => s.sandboxId), [...ids].reverse())
    const byTemplate = await Sandbox.list({ query: { metadata: { tag }, template: 'base' } }).nextItems()
    assert.equal(byTemplate.length, 3)
    assert.deepEqual(await Sandbox.list({ query: { metadata: { tag }, template: 'other' } }).nextItems(), [])
  } finally {
    for (const s of made) await s.kill()
  }
  assert.deepEqual(await Sandbox.list({ query: { metadata: { tag } } }).nextItems(), [])
})

test('setTimeout moves the end both ways; connect lengthens it, never shortens it', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 60_000 })
  try {
    await sbx.setTimeout(600_000)
    let left = secondsUntil((await sbx.getInfo()).endAt)
    assert.ok(left > 590 && left <= 601, `${left} s left after setTimeout(600 s)`)
    await Sandbox.setTimeout(sbx.sandboxId, 40_000)
    left = secondsUntil((await sbx.getInfo()).endAt)
    assert.ok(left > 30 && left <= 41, `${left} s left after setTimeout(40 s)`)

    // Connecting to a running sandbox: the same sandbox, commands through the new object.
    const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
    assert.equal(again.sandboxId, sbx.sandboxId)
    const endAt = (await again.getInfo()).endAt
    left = secondsUntil(endAt)
    assert.ok(left > 290 && left <= 301, `${left} s left after connect(300 s)`)
    await again.commands.run('echo shared > /tmp/connected')
    assert.equal(await sbx.files.read('/tmp/connected'), 'shared\n')
    // A shorter timeout on connect leaves the end where it was.
    await Sandbox.connect(sbx.sandboxId, { timeoutMs: 30_000 })
    assert.equal((await sbx.getInfo()).endAt.getTime(), endAt.getTime())
    // The instance method connects too.
    const third = await sbx.connect()
    assert.equal(third.sandboxId, sbx.sandboxId)
    assert.equal((await third.commands.run('cat /tmp/connected')).stdout, 'shared\n')
  } finally {
    await sbx.kill()
  }
})

test('pause and resume: files and a running command survive; a paused sandbox pauses no more', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  try {
    await sbx.files.write('/tmp/persist/before.txt', 'written before the pause')
    const h = await sbx.commands.run('touch /tmp/bg.started; exec sleep 303', { background: true })
    await waitUntil('the command to start', () => exists(sbx, '/tmp/bg.started'))

    assert.equal(await sbx.pause(), true)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    // A paused sandbox is there (envd's /health answers while it is paused).
    assert.equal(await sbx.isRunning(), true)
    // Pausing a paused sandbox: E2B's 409, which the SDK reports as false; the deprecated
    // spelling is the same call.
    assert.equal(await Sandbox.pause(sbx.sandboxId), false)
    assert.equal(await sbx.betaPause(), false)

    // Sandbox.connect resumes it.
    const resumed = await Sandbox.connect(sbx.sandboxId)
    assert.equal(resumed.sandboxId, sbx.sandboxId)
    assert.equal((await resumed.getInfo()).state, 'running')
    assert.equal(await resumed.files.read('/tmp/persist/before.txt'), 'written before the pause')
    assert.ok((await pids(resumed)).includes(h.pid), 'the background command is listed after the resume')
    assert.equal(await resumed.commands.kill(h.pid), true)
    await waitUntil('the killed command to leave the list', async () => !(await pids(resumed)).includes(h.pid))

    // Files written between pauses all persist (the deprecated betaPause pauses too).
    let cur = resumed
    for (let i = 0; i < 3; i++) {
      await cur.files.write(`/tmp/cycle/${i}.txt`, `round ${i}`)
      assert.equal(i % 2 === 0 ? await cur.pause() : await cur.betaPause(), true)
      cur = await Sandbox.connect(sbx.sandboxId)
    }
    for (let i = 0; i < 3; i++) assert.equal(await cur.files.read(`/tmp/cycle/${i}.txt`), `round ${i}`)
  } finally {
    await sbx.kill()
  }
})

test('a sandbox paused on timeout keeps its lifecycle and resumes on connect', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 60_000, lifecycle: { onTimeout: 'pause' } })
  try {
    assert.deepEqual((await sbx.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: true })
    assert.equal(await sbx.pause(), true)
    const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
    const info = await again.getInfo()
    assert.equal(info.state, 'running')
    const left = secondsUntil(info.endAt)
    assert.ok(left > 590 && left <= 601, `${left} s left after connect(600 s)`)
    assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
  } finally {
    await sbx.kill()
  }
})

test('errors are the SDK classes: unknown sandbox, unknown template, bad key, refused options', async () => {
  const unknown = 'node-0-0000000000000000'
  const e = await rejectsWith(Sandbox.getInfo(unknown), SandboxNotFoundError)
  assert.ok(e instanceof NotFoundError)
  assert.equal(await Sandbox.kill(unknown), false)
  await rejectsWith(Sandbox.connect(unknown), NotFoundError)
  await rejectsWith(Sandbox.setTimeout(unknown, 10_000), NotFoundError)

  // An unknown template is a 404 naming it (and the templates offered).
  const t = await rejectsWith(Sandbox.create('no-such-template'), SandboxError)
  assert.equal(t.statusCode, 404)
  assert.match(t.message, /^404: .*no-such-template.*base/)

  const a = await rejectsWith(Sandbox.create({ apiKey: 'dsk.nobody.nosecret' }), AuthenticationError)
  assert.match(a.message, /^Unauthorized/)

  // Options the gateway cannot honour are refused by name, never ignored.
  const n = await rejectsWith(Sandbox.create({ network: { allowOut: ['192.0.2.1'] } }), SandboxError)
  assert.equal(n.statusCode, 400)
  assert.match(n.message, /allowOut/)
  const big = await rejectsWith(Sandbox.create({ timeoutMs: 1e12 }), SandboxError)
  assert.equal(big.statusCode, 400)
  assert.match(big.message, /longest timeout/)
  // Snapshots and forks copy the files of a store image's sandbox: `base` is the node-local
  // development image `host`, so both are refused by name.
  const sbx = await Sandbox.create()
  try {
    const snap = await rejectsWith(sbx.createSnapshot({ name: 'never' }), SandboxError)
    assert.equal(snap.statusCode, 400)
    assert.match(snap.message, /node-local/)
    const fork = await rejectsWith(sbx.fork(), SandboxError)
    assert.equal(fork.statusCode, 400)
    assert.match(fork.message, /node-local/)
    assert.deepEqual(await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems(), [])
  } finally {
    await sbx.kill()
  }
  // A refused creation made nothing.
  const left = await Sandbox.list({ query: { template: 'no-such-template' } }).nextItems()
  assert.deepEqual(left, [])
})
