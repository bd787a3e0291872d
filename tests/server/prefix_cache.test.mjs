// The prefix cache through the HTTP API: a multi-turn chat whose every turn resends the whole
// conversation. Turn n+1 reuses the prefix saved where turn n ended (its prompt and answer;
// usage.prompt_tokens_details.cached_tokens), and every response's tokens equal a server without
// the cache. The drafter resumes from its checkpoint at the boundary: with n-gram (whose state is
// the token history) its statistics equal the cold server's too; MTP resumes at a turn's end from
// the rows it kept while decoding, as the same conversation uninterrupted would, which may draft
// differently from a cold prefill of the same tokens (the tokens never differ).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { startServer, metrics } from './harness.mjs';

const model = 'qwen35-demo';
const servers = {};

before(async () => {
  const started = await Promise.all(['mtp', 'ngram'].flatMap((draft) => {
    // The cached servers run at the default budget: what a user gets.
    const common = ['--draft', draft, '--depth', '3', '--max-batch', '4'];
    return [startServer(common), startServer([...common, '--prefix-cache-memory', '0'])];
  }));
  servers.mtp = { hot: started[0], cold: started[1] };
  servers.ngram = { hot: started[2], cold: started[3] };
});
after(async () => {
  for (const { hot, cold } of Object.values(servers))
    for (const s of [hot, cold]) assert.equal((await s.stop()).code, 0);
});

const client = (s) => new OpenAI({ baseURL: s.url + '/v1', apiKey: 'unused', maxRetries: 0 });

const isPrefix = (a, b) => a.length <= b.length && a.every((t, i) => t === b[i]);

for (const draft of ['ngram', 'mtp'])
test(`multi-turn chat (${draft}): each turn reuses the last, responses equal a server without the cache`, async () => {
  const { hot, cold } = servers[draft];
  const questions = [
    'def read_config(path):\n    """Read a JSON configuration file."""\n',
    'class Cache:\n    def __init__(self, size):\n',
    'for i in range(10):\n    print(i)\n',
    'def main():\n',
  ];
  const messages = [{ role: 'system', content: 'You write Python.' }];
  let previous = null;
  let hits = 0;
  for (const [turn, q] of questions.entries()) {
    messages.push({ role: 'user', content: q });
    const args = { model, messages, max_tokens: 24, temperature: turn % 2 ? 0.8 : 0, seed: 40 + turn,
                   return_token_ids: true };
    const [h, c] = await Promise.all([client(hot).chat.completions.create(args),
                                      client(cold).chat.completions.create(args)]);
    assert.deepEqual(h.prompt_token_ids, c.prompt_token_ids);
    assert.deepEqual(h.choices[0].token_ids, c.choices[0].token_ids, `turn ${turn}`);
    assert.equal(h.choices[0].message.content, c.choices[0].message.content);
    if (draft === 'ngram') assert.deepEqual(h.usage.speculation, c.usage.speculation, `turn ${turn}: speculation`);
    assert.equal(c.usage.prompt_tokens_details.cached_tokens, 0);
    // The longest saved boundary (on the CPU) is where the previous turn ended — its prompt and
    // the answer tokens the target processed, all but the last — when the template renders the
    // answer back to the same tokens, else the previous prompt's end.
    const cached = h.usage.prompt_tokens_details.cached_tokens;
    const ids = h.prompt_token_ids;
    if (previous && isPrefix(previous.turnEnd, ids) && previous.turnEnd.length < ids.length) {
      assert.equal(cached, previous.turnEnd.length, `turn ${turn}`);
      ++hits;
    } else if (previous && isPrefix(previous.prompt, ids) && previous.prompt.length < ids.length) {
      assert.equal(cached, previous.prompt.length, `turn ${turn}`);
      ++hits;
    } else if (!previous) {
      assert.equal(cached, 0);
    }
    assert.ok(cached < h.usage.prompt_tokens);
    previous = { prompt: ids, turnEnd: [...ids, ...h.choices[0].token_ids.slice(0, -1)] };
    messages.push({ role: 'assistant', content: h.choices[0].message.content });
  }
  assert.ok(hits >= 2, `only ${hits} turns extended the previous prompt`);

  const m = await metrics(hot.url);
  assert.ok(m['tandem_prefix_cache_requests_total{tier="memory",result="hit"}'] >= hits);
  assert.ok(m['tandem_prefix_cache_reused_tokens_total'] > 0);
  assert.ok(m['tandem_prefix_cache_entries'] >= questions.length);
  assert.ok(m['tandem_prefix_cache_bytes'] > 0);
  assert.ok(m['tandem_prefix_cache_bytes'] <= m['tandem_prefix_cache_max_bytes']);
  const off = await metrics(cold.url);
  assert.equal(off['tandem_prefix_cache_requests_total{tier="memory",result="hit"}'], 0);
  assert.equal(off['tandem_prefix_cache_max_bytes'], 0);
});

test('concurrent requests sharing a long system prompt reuse it and equal the server without the cache', async () => {
  const { hot, cold } = servers.mtp;
  // Longer than one 256-token prefill chunk: its first chunk's end is a saved boundary.
  const system = 'You write Python. ' + 'Keep functions short and name things for what they are. '.repeat(30);
  const users = ['def add(a, b):\n', 'def parse(line):\n', 'import os\n', 'class Point:\n', 'def main():\n', 'x = [\n'];
  const ask = (s, u, i) => client(s).chat.completions.create({
    model, messages: [{ role: 'system', content: system }, { role: 'user', content: u }],
    max_tokens: 12, temperature: i % 2 ? 0.7 : 0, seed: i, return_token_ids: true,
  });
  // One first, so that its boundaries are saved; then the rest at once.
  const first = await ask(hot, users[0], 0);
  assert.ok(first.usage.prompt_tokens > 300);
  const rest = await Promise.all(users.slice(1).map((u, i) => ask(hot, u, i + 1)));
  const want = await Promise.all(users.map((u, i) => ask(cold, u, i)));
  for (const [i, r] of [first, ...rest].entries()) {
    assert.deepEqual(r.choices[0].token_ids, want[i].choices[0].token_ids, `request ${i}`);
    assert.deepEqual(r.usage.speculation, want[i].usage.speculation, `request ${i}`);
  }
  for (const r of rest) {
    const shared = first.prompt_token_ids.findIndex((t, k) => t !== r.prompt_token_ids[k]);
    assert.ok(shared >= 256);
    assert.equal(r.usage.prompt_tokens_details.cached_tokens, 256);
  }
});

test('disk tier: a restarted server reads the prefixes the last one saved', async () => {
  const fs = await import('node:fs');
  const os = await import('node:os');
  const path = await import('node:path');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tandem-prefix-'));
  const args = ['--draft', 'mtp', '--depth', '3', '--max-batch', '4', '--prefix-cache-dir', dir];
  const code = 'import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n'.repeat(4);
  const first = { model, prompt: code, max_tokens: 8, temperature: 0, return_token_ids: true };
  const longer = { ...first, prompt: code + 'def save(path, data):\n', max_tokens: 16, temperature: 0.7, seed: 3 };
  try {
    let s = await startServer([...args, '--prefix-cache-persist']);
    const r1 = await client(s).completions.create(first);
    assert.equal((await s.stop()).code, 0);
    assert.ok(fs.readdirSync(dir).some((f) => f.endsWith('.tpc')), 'the shutdown wrote the cache');
    // A file that is not a whole prefix-cache file is a miss and is removed.
    fs.writeFileSync(path.join(dir, 'broken.tpc'), 'TANDEMPC and nothing else');
    s = await startServer(args);
    const hot = await client(s).completions.create(longer);
    const m = await metrics(s.url);
    assert.equal((await s.stop()).code, 0);
    const want = await client(servers.mtp.cold).completions.create(longer);
    assert.deepEqual(hot.choices[0].token_ids, want.choices[0].token_ids);
    assert.equal(hot.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens);
    assert.equal(m['tandem_prefix_cache_requests_total{tier="disk",result="hit"}'], 1);
    assert.equal(m['tandem_prefix_cache_disk_removed_total'], 1);
    assert.ok(!fs.existsSync(path.join(dir, 'broken.tpc')));
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
