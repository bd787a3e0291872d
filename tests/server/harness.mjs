// Starts `tandem serve` on a free port for a test file and runs `tandem generate` as the
// oracle. TANDEM_BINARY and TANDEM_SOURCE_DIR come from ctest.
import assert from 'node:assert/strict';
import { spawn, execFile } from 'node:child_process';
import { promisify } from 'node:util';
import path from 'node:path';

export const binary = process.env.TANDEM_BINARY;
export const sourceDir = process.env.TANDEM_SOURCE_DIR;
if (!binary || !sourceDir) throw new Error('set TANDEM_BINARY and TANDEM_SOURCE_DIR');
export const demoModel = path.join(sourceDir, 'models', 'qwen35-demo');
export const glmDemoModel = path.join(sourceDir, 'models', 'glm5-demo');

// Resolves once the server prints its address; `server.url`, `server.stop()`, `server.exited`.
export async function startServer(args = [], model = demoModel) {
  const proc = spawn(binary, ['serve', '--model', model, '--port', '0', '--threads', '2', ...args],
                     { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('server did not start:\n' + log)), 60000);
    proc.stderr.on('data', (d) => {
      log += d.toString();
      const m = log.match(/listening on (http:\/\/[^\s]+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    exited.then(({ code }) => reject(new Error(`server exited (${code}) before listening:\n${log}`)));
  });
  return {
    url,
    proc,
    exited,
    log: () => log,
    async stop() {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGTERM');
      return exited;
    },
  };
}

// What `tandem generate` alone emits for these token ids and sampling parameters. Asynchronous:
// a test that blocked its event loop here would find its kept-alive connections closed by the
// server's idle timeout behind the HTTP client's back.
export async function generateAlone({ promptIds, maxTokens, temperature = 0, topP = 1, topK = 0, minP = 0, seed = 0,
                                draft = 'none', model = demoModel }) {
  const { stdout } = await promisify(execFile)(binary, [
    'generate', '--model', model, '--token-ids', promptIds.join(','), '--max-tokens', String(maxTokens),
    '--temperature', String(temperature), '--top-p', String(topP), '--top-k', String(topK),
    '--min-p', String(minP), '--seed', String(seed), '--draft', draft, '--json', '--threads', '1',
  ], { encoding: 'utf8' });
  return JSON.parse(stdout);
}

export async function postJson(url, route, body, headers = {}) {
  const res = await fetch(url + route, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' || body instanceof Uint8Array ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, json, text };
}

// Prometheus text -> { 'name{labels}': value }.
export async function metrics(url, headers = {}) {
  const res = await fetch(url + '/metrics', { headers });
  const out = {};
  for (const line of (await res.text()).split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Server-sent events of a streamed response: the parsed `data:` objects, then '[DONE]'.
export async function readEvents(res, onEvent = () => true) {
  const decoder = new TextDecoder();
  let buf = '';
  const events = [];
  for await (const chunk of res.body) {
    buf += decoder.decode(chunk, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (!block.startsWith('data: ')) continue;
      const data = block.slice(6);
      const ev = data === '[DONE]' ? '[DONE]' : JSON.parse(data);
      events.push(ev);
      if (!onEvent(ev)) return events;
    }
  }
  return events;
}

// Six prompts sent concurrently at temperatures 0 / 0.7 / 1.0 (staggered by 30 ms), then the same
// prompts with another ending, so each restores its prefix from the prefix cache; every response
// must equal `tandem generate` of the same request alone (plain decoding, no drafter).
// maxTokens(i) and seed(i) pick request i's; `name` is the request's model field.
export async function concurrentAndCachedEqualAlone(server, { prompts, name, model = demoModel,
                                                              maxTokens, seed }) {
  const run = async (i, prompt) => {
    const body = { model: name, prompt, max_tokens: maxTokens(i), temperature: [0, 0.7, 1.0][i % 3],
                   seed: seed(i), return_token_ids: true };
    await sleep(i * 30);
    const r = await postJson(server.url, '/v1/completions', body);
    assert.equal(r.status, 200, r.text);
    return { body, ids: r.json.choices[0].token_ids, promptIds: r.json.prompt_token_ids };
  };
  const first = await Promise.all(prompts.slice(0, 6).map((p, i) => run(i, p)));
  const second = await Promise.all(prompts.slice(0, 6).map((p, i) => run(i + 6, p + '    # again\n')));
  for (const r of [...first, ...second]) {
    const want = await generateAlone({ promptIds: r.promptIds, maxTokens: r.body.max_tokens,
                                       temperature: r.body.temperature, seed: r.body.seed, model });
    assert.deepEqual(r.ids, want.tokens, `prompt ${JSON.stringify(r.body.prompt.slice(0, 40))}`);
  }
}
