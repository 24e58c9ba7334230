// Open every slide of a built deck in Chromium and report, as JSON on stdout:
// - requests: every request the pages made to a host other than this machine (must be none:
//   the decks are shown in lecture halls without a network, and leak nothing to anyone);
// - brokenImages: images on a slide that did not load; loadedImages: (slide, src) of those that did;
// - overflows: slides whose content does not fit (cut at the bottom or right, or code lines cut);
// - slides: how many slides were opened.
//
//   node check-built-decks.mjs <chromium> <deck URL, e.g. http://127.0.0.1:8000/01-why/> <slides>
import { chromium } from 'playwright-chromium'

const [executablePath, deckUrl, slideCount] = process.argv.slice(2)
if (!executablePath || !deckUrl || !slideCount) {
  console.error('usage: node check-built-decks.mjs <chromium> <deck URL> <number of slides>')
  process.exit(2)
}

const local = new Set(['127.0.0.1', 'localhost', '[::1]'])
const requests = []
const brokenImages = []
const loadedImages = []
const overflows = []
const browser = await chromium.launch({
  executablePath,
  args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
    '--disable-sync', '--no-first-run'],
})
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 720 } })
  page.on('request', (request) => {
    const url = new URL(request.url())
    if (!['data:', 'blob:'].includes(url.protocol) && !local.has(url.hostname))
      requests.push(request.url())
  })
  for (let slide = 1; slide <= Number(slideCount); slide++) {
    await page.goto(`${deckUrl}#/${slide}`, { waitUntil: 'networkidle' })
    // the page's frame is attached before its layout is rendered (later still on a loaded machine)
    await page.waitForSelector(`.slidev-page-${slide} .slidev-layout`, { state: 'attached' })
    // then its images settle (loaded or failed: both are complete) and two frames are drawn
    await page.waitForFunction(
      (n) => [...document.querySelectorAll(`.slidev-page-${n} img`)].every((image) => image.complete), slide)
    await page.evaluate(() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done))))
    const images = await page.$$eval(`.slidev-page-${slide} img`, (found) =>
      found.map((image) => ({ src: image.getAttribute('src'), loaded: image.complete && image.naturalWidth > 0 })))
    for (const { src, loaded } of images) (loaded ? loadedImages : brokenImages).push({ slide, src })
    const cut = await page.$eval(`.slidev-page-${slide} .slidev-layout`, (layout) => {
      const found = []
      if (layout.scrollHeight > layout.clientHeight + 2) found.push(`${layout.scrollHeight - layout.clientHeight} px too tall`)
      if (layout.scrollWidth > layout.clientWidth + 2) found.push(`${layout.scrollWidth - layout.clientWidth} px too wide`)
      for (const pre of layout.querySelectorAll('pre')) {
        if (pre.scrollWidth > pre.clientWidth + 2)
          found.push(`code lines cut (${pre.scrollWidth - pre.clientWidth} px): ${pre.textContent.trim().slice(0, 40)}...`)
      }
      return found
    })
    for (const what of cut) overflows.push({ slide, what })
  }
}
finally {
  await browser.close()
}
console.log(JSON.stringify({ slides: Number(slideCount), requests, brokenImages, loadedImages, overflows }))
