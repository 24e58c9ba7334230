import { defineConfig } from 'vite'

export default defineConfig({
  // The bundler's plugin-timing report is a hint for Slidev's own developers, not for someone
  // building the lectures: keep the build output quiet.
  build: {
    rolldownOptions: {
      checks: { pluginTimings: false },
    },
  },
  plugins: [
    {
      // `make slides-build` prints each built deck to PDF from its /print page (export-built-decks.mjs).
      // Slidev builds that page only when the deck offers a PDF download, and then exports the PDF
      // itself with one browser per deck; keep the page, leave the export to the one browser.
      name: 'course:print-page',
      enforce: 'post',
      config: () => ({ define: { __SLIDEV_FEATURE_PRINT__: 'true' } }),
    },
  ],
})
