import { defineConfig } from 'vite'

// Slidev reads this file for every deck. The bundler's plugin-timing report is a hint for
// Slidev's own developers, not for someone building the lectures: keep the build output quiet.
export default defineConfig({
  build: {
    rolldownOptions: {
      checks: { pluginTimings: false },
    },
  },
})
