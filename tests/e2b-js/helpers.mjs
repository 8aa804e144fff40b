// Shared by the node:test files of tests/e2b-js (not a test file itself: node --test runs
// only *.test.mjs here). The suite drives E2B's own `e2b` npm package, unchanged, against
// the gateway of `opendsec cluster up` (docs/e2b.md); scripts/test-e2b-js.sh starts the
// cluster, exports E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, and points
// tests/e2b-js/node_modules at the release under test.

import assert from 'node:assert/strict'
import http from 'node:http'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  assert.ok(process.env[name], `${name} is not set: run the suite with scripts/test-e2b-js.sh`)
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

/** Polls `f` (sync or async) until it returns a truthy value; fails after `limitMs`. */
export async function waitUntil(what, f, limitMs = 10_000, everyMs = 50) {
  const deadline = Date.now() + limitMs
  for (;;) {
    const v = await f()
    if (v) return v
    assert.ok(Date.now() < deadline, `timed out after ${limitMs} ms waiting for ${what}`)
    await sleep(everyMs)
  }
}

/** The pids of the commands the sandbox lists, sorted. */
export async function pids(sbx) {
  return (await sbx.commands.list()).map((p) => p.pid).sort((a, b) => a - b)
}

/** How many `sleep` processes run in the sandbox with an argument matching `pattern`. */
export async function sleeps(sbx, pattern) {
  const r = await sbx.commands.run(`pgrep -a -x sleep | grep -c -E ' ${pattern}$' || true`)
  return Number(r.stdout.trim())
}

/** Whether `marker` exists in the sandbox (a command shows it is past its shell's start-up:
 * a login shell killed while it reads the profile can leave the profile's lock files behind,
 * and the next login shell then waits on them). */
export async function exists(sbx, marker) {
  return (await sbx.commands.run(`test -e ${marker} && echo yes || true`)).stdout === 'yes\n'
}

/** One plain HTTP request to the gateway (node:http, so any header may be sent): status,
 * headers and body as a Buffer. */
export function gatewayRequest({ method = 'GET', path = '/', headers = {}, body } = {}) {
  const url = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: url.hostname, port: url.port, method, path, headers, timeout: 30_000 },
      (res) => {
        const chunks = []
        res.on('data', (c) => chunks.push(c))
        res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks) }))
        res.on('error', reject)
      },
    )
    req.on('timeout', () => req.destroy(new Error(`${method} ${path}: no answer in 30 s`)))
    req.on('error', reject)
    req.end(body)
  })
}

/** Asserts that `promise` rejects with an instance of `cls` and returns the error. */
export async function rejectsWith(promise, cls) {
  let err
  await assert.rejects(promise, (e) => {
    err = e
    return true
  })
  assert.ok(err instanceof cls, `expected ${cls.name}, got ${err?.constructor?.name}: ${err?.message}`)
  return err
}
