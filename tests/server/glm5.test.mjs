// `tandem serve` with a GLM-5 target (the bundled GLM-5 demo and its NextN drafter): concurrent
// clients at several temperatures each get exactly what `tandem generate` alone gives, also when
// a later request restores an earlier one's prefix from the prefix cache, or a restarted server
// from the files its prefix cache's disk tier left.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, concurrentAndCachedEqualAlone, metrics, sourceDir, glmDemoModel, postJson,
         generateAlone } from './harness.mjs';

const prompts = fs.readFileSync(path.join(sourceDir, 'models/glm5-demo/prompts.jsonl'), 'utf8')
  .split('\n').filter(Boolean).map((l) => JSON.parse(l).prompt);

test('GLM-5: concurrent clients and prefix-cache hits equal tandem generate alone', async () => {
  const server = await startServer(['--draft', 'mtp', '--depth', '3', '--max-batch', '4',
                                    '--prefill-chunk', '16'], glmDemoModel);
  try {
    await concurrentAndCachedEqualAlone(server, { prompts, name: 'glm5-demo', model: glmDemoModel,
                                                  maxTokens: (i) => 12 + (i * 5) % 20, seed: (i) => 500 + i });
    const m = await metrics(server.url);
    assert.ok(m['tandem_prefix_cache_requests_total{tier="memory",result="hit"}'] >= 6, JSON.stringify(m));
  } finally {
    const { code } = await server.stop();
    assert.equal(code, 0, server.log());
  }
});

test('GLM-5: a restarted server reads the prefixes the last one saved to its disk tier', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tandem-glm-prefix-'));
  const args = ['--draft', 'mtp', '--depth', '3', '--max-batch', '4', '--prefill-chunk', '16',
                '--prefix-cache-dir', dir];
  const first = { model: 'glm5-demo', prompt: prompts[0], max_tokens: 8, temperature: 0,
                  return_token_ids: true };
  const longer = { ...first, prompt: prompts[0] + prompts[1], max_tokens: 12, temperature: 0.7,
                   seed: 3 };
  try {
    let s = await startServer([...args, '--prefix-cache-persist'], glmDemoModel);
    const r1 = await postJson(s.url, '/v1/completions', first);
    assert.equal(r1.status, 200, r1.text);
    assert.equal((await s.stop()).code, 0, s.log());
    assert.ok(fs.readdirSync(dir).some((f) => f.endsWith('.tpc')), 'the shutdown wrote the cache');
    s = await startServer(args, glmDemoModel);
    const hot = await postJson(s.url, '/v1/completions', longer);
    const m = await metrics(s.url);
    assert.equal((await s.stop()).code, 0, s.log());
    assert.equal(hot.status, 200, hot.text);
    // The longest boundary of the prefill grid inside the first prompt came from the disk.
    const firstTokens = r1.json.prompt_token_ids.length;
    assert.equal(hot.json.usage.prompt_tokens_details.cached_tokens,
                 Math.floor(firstTokens / 16) * 16);
    assert.equal(m['tandem_prefix_cache_requests_total{tier="disk",result="hit"}'], 1);
    const want = await generateAlone({ promptIds: hot.json.prompt_token_ids, maxTokens: 12,
                                       temperature: 0.7, seed: 3, model: glmDemoModel });
    assert.deepEqual(hot.json.choices[0].token_ids, want.tokens);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
