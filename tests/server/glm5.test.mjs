// `tandem serve` with a GLM-5 target (the bundled GLM-5 demo and its NextN drafter): concurrent
// clients at several temperatures each get exactly what `tandem generate` alone gives, also when
// a later request restores an earlier one's prefix from the prefix cache.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { startServer, concurrentAndCachedEqualAlone, metrics, sourceDir, glmDemoModel } from './harness.mjs';

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
