import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    globalSetup: ['test/server.setup.ts'],
    testTimeout: 60_000,
    hookTimeout: 120_000,
    // NOTE: one real server is shared; files run one after another to keep metrics exact.
    fileParallelism: false,
  },
});
