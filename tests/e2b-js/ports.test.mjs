// A server in a sandbox reached through the gateway (docs/e2b.md "Ports"): the host
// `getHost(port)` names, served by the gateway from the headers the SDK itself sends with
// E2B_SANDBOX_URL set (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`), with the sandbox's traffic
// token; E2B's proxy answers for a closed port and a missing sandbox.

import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'

import { Sandbox } from 'e2b'

import { gatewayRequest, waitUntil } from './helpers.mjs'

let sbx
const BIG = Buffer.alloc(256 * 20_000).map((_, i) => i % 256)

before(async () => {
  sbx = await Sandbox.create()
  await sbx.files.write('/tmp/www/index.html', 'hello from the sandbox\n')
  await sbx.files.write('/tmp/www/big.bin', BIG.buffer.slice(BIG.byteOffset, BIG.byteOffset + BIG.byteLength))
  await sbx.commands.run('cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1', { background: true })
})

after(async () => {
  await sbx?.kill()
})

/** The port and sandbox id of a host `getHost` returned: `<port>-<sandbox id>.<domain>`. */
function parseHost(host) {
  const m = /^(\d+)-(.+)\.([^.]+\.[^.]+)$/.exec(host)
  assert.ok(m, `unexpected host ${host}`)
  return { port: m[1], sandboxId: m[2], domain: m[3] }
}

/** A GET for `path` on the server `host` names, through the gateway with the headers that
 * name a sandbox's port (without `e2b.domain` the gateway cannot be reached by that name). */
function get(host, path, token = sbx.trafficAccessToken) {
  const { port, sandboxId } = parseHost(host)
  const headers = { 'E2b-Sandbox-Id': sandboxId, 'E2b-Sandbox-Port': port }
  if (token) headers['X-Access-Token'] = token
  return gatewayRequest({ path, headers })
}

test('getHost(port) names the port of this sandbox', () => {
  // Without e2b.domain the SDK fills in E2B's own domain (docs/e2b.md "Ports").
  assert.equal(sbx.getHost(8000), `8000-${sbx.sandboxId}.${sbx.sandboxDomain}`)
  assert.deepEqual(parseHost(sbx.getHost(8000)), { port: '8000', sandboxId: sbx.sandboxId, domain: sbx.sandboxDomain })
  // The traffic token is the sandbox's access token: dsg.<sandbox id with its dot>.<MAC>.
  assert.match(sbx.trafficAccessToken, /^dsg\.node-0\.[0-9a-f]{16}\.[A-Za-z0-9_-]+$/)
})

test('an HTTP server started in the sandbox answers at getHost(port)', async () => {
  const host = sbx.getHost(8000)
  await waitUntil('the server to listen', async () => (await get(host, '/index.html')).status !== 502, 20_000, 200)
  const r = await get(host, '/index.html')
  assert.equal(r.status, 200)
  assert.equal(r.body.toString(), 'hello from the sandbox\n')
  const big = await get(host, '/big.bin')
  assert.equal(big.status, 200)
  assert.ok(big.body.equals(BIG), `got ${big.body.length} bytes`)
  // The caller's API key is taken too; no token, or a wrong one, is refused.
  assert.equal((await get(host, '/index.html', process.env.E2B_API_KEY)).status, 200)
  const none = await get(host, '/index.html', null)
  assert.equal(none.status, 401)
  assert.equal(JSON.parse(none.body).code, 401)
  assert.equal((await get(host, '/index.html', 'dsk.nobody.wrong')).status, 401)
})

test('a closed port and a missing sandbox get E2B proxy answers', async () => {
  const closed = await get(sbx.getHost(8999), '/')
  assert.equal(closed.status, 502)
  assert.equal(JSON.parse(closed.body).message, 'The sandbox is running but port is not open')

  const gone = await Sandbox.create()
  const host = gone.getHost(8000)
  assert.equal(await gone.kill(), true)
  const r = await get(host, '/', process.env.E2B_API_KEY)
  assert.equal(r.status, 502)
  assert.equal(JSON.parse(r.body).message, 'The sandbox was not found')
})
