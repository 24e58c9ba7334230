// Print built decks to PDF in one Chromium, one page per slide, as `slidev export` would, but from
// the static site `slidev build` wrote (no development server per deck) and only once every slide
// has really drawn: its loading placeholders gone, its images decoded, its fonts loaded.
//
//   node export-built-decks.mjs <chromium> <site directory> <PDF directory> <deck name>...
//
// A deck whose slides do not all draw is an error (exit 1, naming the deck and the slides).
import { createReadStream } from 'node:fs'
import { mkdir, stat } from 'node:fs/promises'
import { createServer } from 'node:http'
import { extname, join, normalize, resolve } from 'node:path'
import { chromium } from 'playwright-chromium'

const [executablePath, siteDir, pdfDir, ...decks] = process.argv.slice(2)
if (!executablePath || !siteDir || !pdfDir || decks.length === 0) {
  console.error('usage: node export-built-decks.mjs <chromium> <site directory> <PDF directory> <deck name>...')
  process.exit(2)
}

// The built site loads its scripts as modules, which Chromium refuses from file://, so it is served
// over HTTP on this machine only, for as long as the export runs.
const types = { '.html': 'text/html', '.js': 'text/javascript', '.mjs': 'text/javascript', '.css': 'text/css',
  '.svg': 'image/svg+xml', '.png': 'image/png', '.json': 'application/json', '.woff2': 'font/woff2' }
const root = resolve(siteDir)
const server = createServer(async (request, response) => {
  let path = normalize(join(root, decodeURIComponent(new URL(request.url, 'http://x').pathname)))
  try {
    if (!path.startsWith(root)) throw new Error('outside the site')
    if ((await stat(path)).isDirectory()) path = join(path, 'index.html')
    await stat(path)
    response.writeHead(200, { 'content-type': types[extname(path)] ?? 'application/octet-stream' })
    createReadStream(path).pipe(response)
  }
  catch {
    response.writeHead(404).end()
  }
})
await new Promise((ready) => server.listen(0, '127.0.0.1', ready))
const site = `http://127.0.0.1:${server.address().port}`

const browser = await chromium.launch({
  executablePath,
  args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
    '--disable-sync', '--no-first-run'],
})
let failed = false
try {
  await mkdir(pdfDir, { recursive: true })
  // Slidev's canvas: 980 px wide, 16:9 (no deck changes canvasWidth or aspectRatio).
  const page = await browser.newPage({ viewport: { width: 980, height: 551 }, deviceScaleFactor: 2 })
  for (const deck of decks) {
    await page.goto(`${site}/${deck}/?print=true#/print`, { waitUntil: 'networkidle', timeout: 60000 })
    await page.emulateMedia({ colorScheme: 'light', media: 'screen' })
    await page.waitForSelector('.print-slide-container', { timeout: 60000 })
    // A page a slide, at the slide's own size; the window as tall as all of them, as slidev export
    // does, so that no scroll bar is printed.
    const slides = await page.locator('.print-slide-container').count()
    const { width, height } = await page.locator('.print-slide-container').first().boundingBox()
    await page.setViewportSize({ width: Math.round(width), height: Math.round(height) * slides })
    // Printed only once every slide has drawn: under load, a slide printed too early comes out blank.
    const drawn = await page.waitForFunction(() => {
      if (document.querySelector('.slidev-slide-loading')) return false
      const containers = [...document.querySelectorAll('.print-slide-container')]
      return containers.every((container) => container.innerText.trim() !== '' || container.querySelector('img'))
    }, null, { timeout: 60000 }).then(() => true, () => false)
    if (!drawn) {
      const empty = await page.$$eval('.print-slide-container', (containers) => containers
        .map((container, index) => [index + 1, container.innerText.trim() !== '' || container.querySelector('img')])
        .filter(([, content]) => !content)
        .map(([number]) => number))
      console.error(`${deck}: slides ${empty.join(', ')} drew nothing within a minute`)
      failed = true
      continue
    }
    await page.evaluate(async () => {
      await document.fonts.ready
      await Promise.all([...document.images].map((image) => image.decode().catch(() => {})))
      await new Promise((painted) => requestAnimationFrame(() => requestAnimationFrame(painted)))
    })
    await page.pdf({
      path: join(pdfDir, `${deck}.pdf`),
      width: `${width}px`,
      height: `${height}px`,
      margin: { left: 0, top: 0, right: 0, bottom: 0 },
      printBackground: true,
      // A fraction of a pixel left over below the last slide would otherwise print one more page.
      pageRanges: `1-${slides}`,
    })
    console.log(`${deck}: ${slides} slides`)
  }
}
finally {
  await browser.close()
  server.close()
}
process.exit(failed ? 1 : 0)
